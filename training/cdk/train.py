"""Training of the two heads (and optionally the backbones) by NestedLoRA on the CDK.

One step: draw B pairs (x_b, y_b) ~ p(x, y) (a ``data.Sampler``: the config's PairSampler
unless one is passed), compute f(x_b), g(y_b): (B, modes), and descend
``training.loss.cdk_loss`` with the method's nesting masks. The frozen-feature path and the
fine-tuning path share that step; they differ only in where a batch's inputs come from
(``FeatureInputs``, ``inputs.ImageInputs``).

Under DDP every rank draws the same global batch and encodes its B/W slice; the
(B, modes) outputs are all-gathered so each rank evaluates the full-batch estimator (its
U-statistic couples all pairs), with gradients flowing only into the local slice. Scaling
the loss by W undoes DDP's gradient averaging, so the update equals the single-process one.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from training.device import pick_device

from ..loss import cdk_loss, nesting_masks
from .checkpoint import load_checkpoint, save_checkpoint
from .config import NESTING_OF, RUNTIME_FIELDS, Config, nesting_weights, to_dict
from .data import PairSampler, Sampler
from .distributed import barrier, gather_rows, rank0_says, rank_and_world
from .finetune import Split, validate_images
from .inputs import FeatureInputs, ImageInputs, PairModel, set_train_mode
from .metrics import spectrum_order
from .model.backbones import Backbone
from .model.heads import MODALITIES, Head, RawProjection, fit_raw_projections
from .spectrum import sort_modes, spectrum

__all__ = ["CHECKPOINT_SECONDS", "TrainData", "TrainResult", "InputDropout", "Step",
           "build_model", "make_optimiser", "measure_training", "spectrum_passes", "train"]

log = logging.getLogger(__name__)

# An epoch ends with the spectrum pass (its sigma in the log) and a checkpoint when it is the
# last, or when this many seconds have passed since the last checkpoint: every epoch of a
# long run, a few of a run of short epochs (the quick start's are 0.3 s; a spectrum pass
# and a 30 MB checkpoint each epoch would add half again to its training).
CHECKPOINT_SECONDS = 30.0


def spectrum_passes(epochs: int, epoch_s: float) -> int:
    """About how many of ``epochs`` epochs of ``epoch_s`` seconds end with a spectrum pass
    and a checkpoint (CHECKPOINT_SECONDS apart, and the last)."""
    return min(epochs, int(epochs * epoch_s // CHECKPOINT_SECONDS) + 1)


@dataclass
class TrainData:
    """Training set. feats: frozen backbone features (N, D) per modality (the inputs of
    the heads, and their standardisation statistics); files: the images, needed only when
    fine-tuning the backbones."""

    sketch_feats: torch.Tensor
    photo_feats: torch.Tensor
    sketch_labels: np.ndarray
    photo_labels: np.ndarray
    photo_of: np.ndarray | None = None
    sketch_files: list | None = None
    photo_files: list | None = None


@dataclass
class TrainResult:
    heads: dict[str, Head]
    backbones: dict[str, nn.Module] | None  # fine-tuned backbones, None if frozen
    singular_values: torch.Tensor  # (modes,) the CDK's Rayleigh quotients (the order's estimate)
    history: list = field(default_factory=list)
    singular_values_norm: torch.Tensor | None = None  # (modes,) sqrt(E f_l^2 E g_l^2)
    # the raw coordinates' projection per modality (cfg.raw_dims), None without them
    raw: dict[str, RawProjection] | None = None
    # metrics.spectrum_order of the modes as trained (before cfg.sort_modes reorders
    # them), and metrics.heldout_order on two halves of the training rows
    order_trained: dict | None = None
    order_heldout: dict | None = None


class InputDropout:
    """The heads' input dropout factors (mask / keep probability) of this rank's rows
    ``rows`` of a global batch of ``batch`` rows, per modality: drawn for all rows from
    this object's own generator and sliced, so a run on W processes equals one on a single
    process, and ``reseed`` at each epoch makes a resumed run draw the same."""

    def __init__(self, rate: float, width: int, batch: int, rows: slice, device):
        self.rate, self.width, self.batch, self.rows, self.device = rate, width, batch, rows, device
        self.gen = torch.Generator()

    def reseed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.rate == 0:
            return None, None
        keep = 1.0 - self.rate
        masks = [torch.rand(self.batch, self.width, generator=self.gen) < keep
                 for _ in MODALITIES]
        return tuple((m[self.rows].float() / keep).to(self.device) for m in masks)


class Step:
    """One optimiser step on a batch: ``step(xs, ys)`` -> the objective's value. ``module``
    maps (xs, ys, dropout scales) to (f, g) (the PairModel, or its DDP wrapper); the loss
    is ``cdk_loss`` with ``masks``; gradients of ``params`` are clipped to norm
    ``grad_clip`` (0: not); mixed precision on CUDA."""

    def __init__(self, module: nn.Module, params, masks, optimiser, scheduler, grad_clip: float,
                 dropout: InputDropout, device: torch.device, world: int = 1, rank: int = 0):
        self.module, self.params, self.masks = module, list(params), masks
        self.optimiser, self.scheduler, self.grad_clip = optimiser, scheduler, grad_clip
        self.dropout, self.device, self.world, self.rank = dropout, device, world, rank
        self.amp = device.type == "cuda"
        self.dtype = (torch.bfloat16 if self.amp and torch.cuda.is_bf16_supported()
                      else torch.float16)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp and self.dtype == torch.float16)

    def __call__(self, xs: torch.Tensor, ys: torch.Tensor) -> float:
        scales = self.dropout()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.amp):
            f, g = self.module(xs, ys, scales)  # (B/W, modes) each
        if self.world > 1:
            f, g = gather_rows(f, self.world, self.rank), gather_rows(g, self.world, self.rank)
        loss = cdk_loss(f.float(), g.float(), *self.masks)
        self.optimiser.zero_grad(set_to_none=True)
        self.scaler.scale(loss * self.world).backward()
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimiser)
            nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.scaler.step(self.optimiser)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.item()


def build_model(data: TrainData, backbone: Backbone, hidden: int, modes: int, mu: float,
                finetune: bool, trainable_stages: int) -> PairModel:
    """The two heads, standardised on the training features, and, when fine-tuning, a copy
    of the backbone per modality split at ``trainable_stages`` with its trunk frozen.
    Draws the heads' initial weights from the global RNG (sketch head first)."""
    heads = {m: Head(backbone.feature_dim, hidden, modes, mu) for m in MODALITIES}
    heads["sketch"].set_feature_stats(data.sketch_feats)
    heads["photo"].set_feature_stats(data.photo_feats)
    if not finetune:
        return PairModel(heads, None)
    bbs = {m: copy.deepcopy(backbone.module) for m in MODALITIES}
    splits = {m: Split(bbs[m], backbone.name, trainable_stages) for m in MODALITIES}
    for s in splits.values():
        s.freeze()
    return PairModel(heads, bbs, splits)


def make_optimiser(model: PairModel, lr: float, backbone_lr: float, momentum: float,
                   weight_decay: float, total_steps: int):
    """SGD over the heads (lr) and the backbones' trainable parameters (backbone_lr), with a
    cosine schedule stepped once per optimiser step: the lr reaches 0 at the last step."""
    groups = [{"params": list(model.heads.parameters()), "lr": lr}]
    if model.backbones is not None:
        groups.append({"params": [p for p in model.backbones.parameters() if p.requires_grad],
                       "lr": backbone_lr})
    opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)


def _resume(path: Path, cfg: Config, model: PairModel, opt, sched) -> tuple[int, list, dict]:
    """(epochs done, history, {"sv", "sv_norm"}) of the run stored at ``path`` (loaded into
    model, opt and sched), or (0, [], {}) when there is none. A run of another config in
    the same place is refused."""
    if not path.is_file():
        return 0, [], {}
    ck = load_checkpoint(path, map_location="cpu")
    mine = to_dict(cfg)
    diff = sorted(k for k in set(ck["config"]) | set(mine)
                  if k not in RUNTIME_FIELDS and ck["config"].get(k) != mine.get(k))
    if diff:
        raise ValueError(f"{path} holds a run with a different config ({diff}); "
                         "use another --out")
    for m in MODALITIES:
        model.heads[m].load_state_dict(ck["heads"][m])
        if model.backbones is not None:
            model.backbones[m].load_state_dict(ck["backbones"][m])
    if ck["epoch"] < cfg.epochs:
        if ck["train_state"] is None:
            raise ValueError(f"{path} has no optimizer state to resume from")
        opt.load_state_dict(ck["train_state"]["optimizer"])
        sched.load_state_dict(ck["train_state"]["scheduler"])
    log.info("resuming from %s at epoch %d/%d", path, ck["epoch"], cfg.epochs)
    return ck["epoch"], ck["history"], {"sv": ck["singular_values"],
                                        "sv_norm": ck.get("singular_values_norm")}


def _measure(model: PairModel, masks, inputs, batches, grad_clip: float,
             dropout: InputDropout, world: int, rank: int, sampler, seed: int
             ) -> tuple[float, float]:
    """(seconds per step, seconds per spectrum pass), timed on a throwaway copy of the model
    (the second of two steps; the first warms up), so the run itself is untouched."""
    probe = copy.deepcopy(model)
    params = [p for p in probe.parameters() if p.requires_grad]
    step = Step(probe, params, masks, torch.optim.SGD(params, lr=0.0), None, grad_clip,
                InputDropout(dropout.rate, dropout.width, dropout.batch, dropout.rows,
                             dropout.device), dropout.device, world, rank)
    set_train_mode(probe)
    times = []
    for xs, ys in inputs.steps(batches[:2], 0):
        t0 = time.perf_counter()
        step(xs, ys)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    spectrum(probe, sampler, inputs, seed)
    return times[-1], time.perf_counter() - t0


def measure_training(cfg: Config, data: TrainData, backbone: Backbone, device=None
                     ) -> tuple[int, float, int, float]:
    """(steps, seconds a step takes, spectrum passes, seconds one takes) of a whole run of
    ``cfg`` on frozen features like ``data``'s, timed on a fresh model: only the features'
    shapes and the labels matter, so random features estimate a run before any image is
    read. The global RNG is seeded as train() seeds it again."""
    device = pick_device(device)
    torch.manual_seed(cfg.seed)
    model = build_model(data, backbone, cfg.hidden, cfg.modes, cfg.mu, False, 0).to(device)
    sampler = PairSampler(data.sketch_labels, data.photo_labels, cfg.pairing, data.photo_of,
                          cfg.instance_share)
    masks = nesting_masks(cfg.modes, NESTING_OF[cfg.method], nesting_weights(cfg),
                          constant_mode=True)
    inputs = FeatureInputs({"sketch": data.sketch_feats.to(device),
                            "photo": data.photo_feats.to(device)}, model)
    B = min(cfg.batch_size, len(data.sketch_labels))
    dropout = InputDropout(cfg.input_dropout, backbone.feature_dim, B, slice(0, B), device)
    batches = list(sampler.epoch(cfg.seed, 0, cfg.batch_size))
    t_step, t_spectrum = _measure(model, masks, inputs, batches, cfg.grad_clip, dropout, 1, 0,
                                  sampler, cfg.seed)
    return (len(batches) * cfg.epochs, t_step,
            spectrum_passes(cfg.epochs, len(batches) * t_step), t_spectrum)


def train(cfg: Config, data: TrainData, backbone: Backbone, out_dir: str | Path, device=None,
          *, sampler: Sampler | None = None, estimate=None) -> TrainResult:
    """Train per ``cfg``, checkpointing to out_dir/checkpoint.pt after every epoch and
    resuming from it when it holds an unfinished run of the same config. Runs under DDP
    when torch.distributed is initialised (launch with torchrun; see ``distributed``).

    sampler: the pair distribution p(x, y) whose CDK is learned, over the rows of ``data``
    (a ``data.Sampler``; None: the config's, data.PairSampler of cfg.pairing and
    cfg.instance_share); it draws every batch and weighs the spectrum pass. estimate:
    called before the first step as estimate(steps left, seconds a step takes, spectrum
    passes left, seconds a spectrum pass takes), both times measured on a copy of the
    model. The spectrum and the checkpoint follow CHECKPOINT_SECONDS."""
    if sampler is not None and not isinstance(sampler, Sampler):
        missing = [m for m in ("steps_per_epoch", "epoch", "joint_moment", "photo_marginal",
                               "halves") if not callable(getattr(sampler, m, None))]
        raise TypeError(f"sampler {type(sampler).__name__} is not a training.cdk.data.Sampler "
                        f"(it lacks {', '.join(missing)})")
    ckpt_path = Path(out_dir) / "checkpoint.pt"
    device = pick_device(device)
    rank, world = rank_and_world()
    B = min(cfg.batch_size, len(data.sketch_labels))
    if B % world:
        raise ValueError(f"batch size {B} is not divisible by the world size {world}")
    if cfg.finetune and (data.sketch_files is None or data.photo_files is None):
        raise ValueError("finetune=True needs the image files in TrainData")
    torch.manual_seed(cfg.seed)
    model = build_model(data, backbone, cfg.hidden, cfg.modes, cfg.mu, cfg.finetune,
                        cfg.trainable_stages).to(device)
    # the raw coordinates' projections: fit once on the (plain) training features
    raw = (fit_raw_projections(data.sketch_feats, data.photo_feats, cfg.raw_dims,
                               cfg.raw_weight, cfg.raw_whiten) if cfg.raw_dims else None)
    if sampler is None:
        sampler = PairSampler(data.sketch_labels, data.photo_labels, cfg.pairing,
                              data.photo_of, cfg.instance_share)
    opt, sched = make_optimiser(model, cfg.lr, cfg.backbone_lr, cfg.momentum, cfg.weight_decay,
                                sampler.steps_per_epoch(cfg.batch_size) * cfg.epochs)
    masks = nesting_masks(cfg.modes, NESTING_OF[cfg.method], nesting_weights(cfg),
                          constant_mode=True)
    start, history, last = _resume(ckpt_path, cfg, model, opt, sched)
    inputs = _inputs(cfg, data, backbone, model, device, training=start < cfg.epochs)
    ddp = model if world == 1 else nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    rows = slice(rank * (B // world), (rank + 1) * (B // world))  # this rank's slice
    dropout = InputDropout(cfg.input_dropout, backbone.feature_dim, B, rows, device)
    step = Step(ddp, model.parameters(), masks, opt, sched, cfg.grad_clip, dropout, device,
                world, rank)

    def batches(epoch):
        return [(s[rows], p[rows]) for s, p in sampler.epoch(cfg.seed, epoch, cfg.batch_size)]

    if estimate is not None and start < cfg.epochs:
        t_step, t_spectrum = _measure(model, masks, inputs, batches(start), cfg.grad_clip,
                                      dropout, world, rank, sampler, cfg.seed)
        left = cfg.epochs - start
        steps = len(batches(start))
        estimate(left * steps, t_step, spectrum_passes(left, steps * t_step), t_spectrum)
    saved = time.perf_counter()
    for epoch in range(start, cfg.epochs):
        t0 = time.perf_counter()
        torch.manual_seed(cfg.seed * 1_000_003 + epoch)  # dropout/drop-connect: resumable
        dropout.reseed(cfg.seed * 1_000_003 + epoch + 500_009)  # its own stream
        set_train_mode(model)
        losses = [step(xs, ys) for xs, ys in inputs.steps(batches(epoch), epoch)]
        due = rank0_says(epoch + 1 == cfg.epochs
                         or time.perf_counter() - saved >= CHECKPOINT_SECONDS, device)
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)),
                        "lr": sched.get_last_lr()[0], "seconds": time.perf_counter() - t0})
        if not due:
            log.info("epoch %d/%d loss %.4f (%.1fs)", epoch + 1, cfg.epochs,
                     history[-1]["loss"], history[-1]["seconds"])
            continue
        last = _end_epoch(cfg, model, sampler, inputs, history, epoch)
        if rank == 0:
            _save(ckpt_path, cfg, backbone, model, raw, last, history, epoch + 1,
                  None if epoch + 1 == cfg.epochs else {"optimizer": opt.state_dict(),
                                                        "scheduler": sched.state_dict()})
        barrier()
        saved = time.perf_counter()
    model.eval()
    final = history[-1] if history else {}
    return TrainResult(dict(model.heads), None if model.backbones is None
                       else dict(model.backbones.items()), last["sv"], history,
                       last.get("sv_norm"), raw, final.get("spectrum_order_trained"),
                       final.get("spectrum_order_heldout"))


def _inputs(cfg: Config, data: TrainData, backbone: Backbone, model: PairModel, device,
            training: bool):
    """Where a step's inputs come from: the frozen features, or (fine-tuning) the images,
    every one decoded once first so that bad data stops the run naming the file."""
    if not cfg.finetune:
        return FeatureInputs({"sketch": data.sketch_feats.to(device),
                              "photo": data.photo_feats.to(device)}, model)
    if training:
        validate_images(data.sketch_files, "checking sketches")
        validate_images(data.photo_files, "checking photos")
    return ImageInputs({"sketch": list(data.sketch_files), "photo": list(data.photo_files)},
                       backbone, model, cfg.image_size, cfg.augment, cfg.seed, cfg.workers,
                       cfg.cache_dir or None, device, cache=training)


def _end_epoch(cfg: Config, model: PairModel, sampler, inputs, history: list, epoch: int
               ) -> dict:
    """The spectrum after an epoch (added to its history entry, the last one), and after
    the last epoch the order check and (cfg.sort_modes) the modes sorted: {"sv",
    "sv_norm"} as they now stand."""
    final = epoch + 1 == cfg.epochs
    sv, sv_norm, held = spectrum(model, sampler, inputs, cfg.seed, heldout=final)
    history[-1]["sigma_top"] = sv[: min(4, cfg.modes)].tolist()
    if final:
        # the order as trained, and whether it holds on held-out halves; then (when
        # cfg.sort_modes) the coordinates in the estimated order
        history[-1]["spectrum_order_trained"] = spectrum_order(sv)
        history[-1]["spectrum_order_heldout"] = held
        if cfg.sort_modes:
            sv, sv_norm, perm = sort_modes(model, sv, sv_norm)
            history[-1]["sorted_from"] = perm.tolist()  # coordinate l was mode perm[l]
    log.info("epoch %d/%d loss %.4f sigma[:4] %s (%.1fs)", epoch + 1, cfg.epochs,
             history[-1]["loss"], [round(v, 3) for v in history[-1]["sigma_top"]],
             history[-1]["seconds"])
    return {"sv": sv, "sv_norm": sv_norm}


def _save(path: Path, cfg: Config, backbone: Backbone, model: PairModel, raw, last: dict,
          history: list, epoch: int, train_state: dict | None) -> None:
    tuned = model.backbones is not None
    save_checkpoint(
        path, config=to_dict(cfg), backbone=backbone, image_size=cfg.image_size,
        backbones=dict(model.backbones.items()) if tuned
        else {"sketch": backbone.module, "photo": backbone.module},
        heads=dict(model.heads), singular_values=last["sv"],
        singular_values_norm=last["sv_norm"], raw=raw, trained=True, epoch=epoch,
        finetuned=tuned, history=history, train_state=train_state)
