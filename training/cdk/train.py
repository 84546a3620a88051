"""Training of the two heads (and optionally the backbones) by NestedLoRA on the CDK.

One step: draw B pairs (x_b, y_b) ~ p(x, y) (data.PairSampler), compute f(x_b), g(y_b):
(B, L), and descend ``training.loss.cdk_loss`` with the method's nesting masks. Under DDP
every rank draws the same global batch and encodes its B/W slice; the (B, L) outputs are
all-gathered so each rank evaluates the full-batch estimator (its U-statistic couples all
pairs), with gradients flowing only into the local slice. Scaling the loss by W undoes
DDP's gradient averaging, so the update equals the single-process one.
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
from torch.utils.data import DataLoader

from training.device import pick_device

from ..loss import cdk_loss, cdk_singular_values, nesting_masks, singular_values
from .config import NESTING_OF, RUNTIME_FIELDS, Config, nesting_weights, to_dict
from .data import PairSampler
from .distributed import barrier, gather_rows, rank_and_world
from .finetune import Split, StepImages, set_train_mode, step_loader, trunk_cache, validate_images
from .metrics import heldout_order, spectrum_order
from .model.backbones import Backbone
from .model.checkpoint import load_checkpoint, save_checkpoint
from .model.heads import MODALITIES, Head, RawProjection, fit_raw_projections

__all__ = ["TrainData", "TrainResult", "train"]

log = logging.getLogger(__name__)


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
    # frozen path: features of augmented views (V, N, D) per modality; each epoch draws,
    # per sampled image, its plain features or one of its V views
    sketch_views: torch.Tensor | None = None
    photo_views: torch.Tensor | None = None


@dataclass
class TrainResult:
    heads: dict[str, Head]
    backbones: dict[str, nn.Module] | None  # fine-tuned backbones, None if frozen
    singular_values: torch.Tensor  # (L,) the CDK's Rayleigh quotients (the ordering estimate)
    history: list = field(default_factory=list)
    singular_values_norm: torch.Tensor | None = None  # (L,) sqrt(E f_l^2 E g_l^2)
    # the raw coordinates' projection per modality (cfg.raw_dims), None without them
    raw: dict[str, RawProjection] | None = None
    # metrics.spectrum_order of the modes as trained (before cfg.sort_modes reorders
    # them), and metrics.heldout_order on two halves of the training rows
    order_trained: dict | None = None
    order_heldout: dict | None = None


class PairModel(nn.Module):
    """(sketch inputs, photo inputs) -> (f (B, L), g (B, L)). Inputs are backbone features,
    or, when backbones are given, the input of their trainable stages (images when the
    whole backbone trains; cached or no-grad trunk activations otherwise)."""

    def __init__(self, heads: dict[str, Head], backbones: dict[str, nn.Module] | None,
                 splits: dict[str, Split] | None = None):
        super().__init__()
        self.heads = nn.ModuleDict(heads)
        self.backbones = nn.ModuleDict(backbones) if backbones else None
        self.splits = splits

    def encode(self, x: torch.Tensor, modality: str,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.backbones is not None:
            x = self.splits[modality].tail(x)
        return self.heads[modality](x, input_scale)

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, scales=(None, None)):
        """scales: the heads' input dropout factors (sketch, photo), each (B, D) or None."""
        return self.encode(xs, "sketch", scales[0]), self.encode(ys, "photo", scales[1])


def _comparable(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in RUNTIME_FIELDS}


class _Inputs:
    """Where the trainable part's inputs come from when fine-tuning: the trunk cache
    (frozen trunk, no augmentation), or images decoded by a DataLoader and, for a frozen
    trunk, run through it without gradients."""

    def __init__(self, cfg: Config, data: TrainData, backbone: Backbone, splits, device):
        self.cfg, self.splits, self.device = cfg, splits, device
        self.files = {"sketch": list(data.sketch_files), "photo": list(data.photo_files)}
        self.images = StepImages(data.sketch_files, data.photo_files, cfg.image_size,
                                 backbone.mean, backbone.std, cfg.augment, cfg.seed)
        self.plain = StepImages(data.sketch_files, data.photo_files, cfg.image_size,
                                backbone.mean, backbone.std, False, cfg.seed)
        self.cache = None
        if cfg.trainable_stages > 0 and not cfg.augment:
            # the trunks of both modalities hold the same frozen weights: one cache each
            self.cache = {m: trunk_cache(splits[m], self.files[m], backbone, cfg.image_size,
                                         device, cfg.cache_dir or None,
                                         desc=f"trunk cache ({m}s)")
                          for m in MODALITIES}

    def steps(self, batches, epoch: int):
        """(sketch inputs, photo inputs) of each (sketch idx, photo idx) batch."""
        if self.cache is not None:
            for s, p in batches:
                yield (self.cache["sketch"][s].to(self.device),
                       self.cache["photo"][p].to(self.device))
            return
        loader = step_loader(self.images, batches, epoch, self.cfg.workers)
        for (s, _), x in zip(batches, loader, strict=True):
            x = x.to(self.device)
            xs, ys = x[: len(s)], x[len(s) :]
            if self.cfg.trainable_stages > 0:
                with torch.no_grad(), self._autocast():
                    xs, ys = self.splits["sketch"].trunk(xs), self.splits["photo"].trunk(ys)
            yield xs, ys

    def _autocast(self):
        return torch.autocast(self.device.type, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def features(self, model: PairModel, modality: str, idx=None) -> torch.Tensor:
        """(n, D) pooled features of the training images ``idx`` (default all) with the
        current backbone in eval mode, without augmentation (what evaluation sees)."""
        files = self.files[modality]
        idx = list(range(len(files))) if idx is None else list(idx)
        split, out = self.splits[modality], []
        chunks = [idx[i : i + 64] for i in range(0, len(idx), 64)]
        images = None
        if self.cache is None:
            # decoded by the loader's workers, unaugmented: the same tensors as decoding here
            mod = MODALITIES.index(modality)
            images = iter(DataLoader(self.plain, num_workers=self.cfg.workers,
                                     batch_sampler=[[(mod, j, 0) for j in c] for c in chunks]))
        for chunk in chunks:
            with self._autocast():
                if images is None:
                    x = self.cache[modality][chunk].to(self.device)
                else:
                    x = split.trunk(next(images).to(self.device))
                out.append(split.tail(x).float())
        return torch.cat(out)


def _train_mode(model: PairModel, cfg: Config) -> None:
    model.train()
    if model.backbones is not None:
        for m in MODALITIES:
            set_train_mode(model.backbones[m], model.splits[m], cfg.bn)


@torch.no_grad()
def _train_outputs(model: PairModel, cfg: Config, feats: dict, inputs: _Inputs | None,
                   sampler: PairSampler) -> tuple[list[torch.Tensor], dict]:
    """The heads' outputs on the training set, [(S, L), (P, L)] on the CPU, and the rows
    they are at ({modality: indices}, None: all): on ``feats`` (N, D) per modality, or,
    while the backbones train, on a seeded subset of at most 1024 sketches and 1024
    photos (their own photos under instance pairing) to bound the cost. Leaves the model
    in eval mode."""
    model.eval()
    idx = {m: None for m in MODALITIES}
    if inputs is not None:
        for m in MODALITIES:
            g = torch.Generator().manual_seed(cfg.seed)
            idx[m] = torch.randperm(len(inputs.files[m]), generator=g)[:1024]
        if cfg.pairing == "instance":
            idx["photo"] = torch.unique(sampler.photo_of[idx["sketch"]])
    out = []
    for mod in MODALITIES:
        x = feats[mod] if inputs is None else inputs.features(model, mod, idx[mod].tolist())
        out.append(torch.cat([model.heads[mod](x[i : i + 8192]).float()
                              for i in range(0, len(x), 8192)]).cpu())
    return out, idx


def _quotients(out: list[torch.Tensor], idx: dict, sampler: PairSampler) -> torch.Tensor:
    joint = sampler.joint_moment(out[0], out[1], idx["sketch"], idx["photo"])
    return cdk_singular_values(out[0], out[1], joint).float()


@torch.no_grad()
def _spectrum(model: PairModel, cfg: Config, feats: dict, inputs: _Inputs | None,
              sampler: PairSampler, heldout: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """(sigma, sigma_norm, held), sigma and sigma_norm (L,) on the training set
    (``_train_outputs``): sigma the CDK's Rayleigh quotients
    (training.loss.cdk_singular_values, the estimate modes are ordered by), sigma_norm =
    sqrt(E f_l(X)^2 E g_l(Y)^2). With ``heldout``, held is metrics.heldout_order of the
    quotients read on two halves of the same rows (PairSampler.halves): is the modes'
    order a property of the functions, or of the sample that estimated it? Else None."""
    out, idx = _train_outputs(model, cfg, feats, inputs, sampler)
    held = None
    if heldout:
        halves = []
        for s_pos, p_pos in sampler.halves(idx["sketch"], idx["photo"]):
            rows = {m: (pos if idx[m] is None else idx[m][pos])
                    for m, pos in (("sketch", s_pos), ("photo", p_pos))}
            halves.append(_quotients([out[0][s_pos], out[1][p_pos]], rows, sampler))
        held = heldout_order(*halves)
    return _quotients(out, idx, sampler), singular_values(out[0], out[1]).float(), held


def _sort_modes(model: PairModel, sv: torch.Tensor, sv_norm: torch.Tensor | None):
    """Both heads' coordinates reordered by decreasing Rayleigh quotient (stable, so an
    ordered run is unchanged): coordinate l is then the mode with the l-th largest
    estimated singular value. Returns sv and sv_norm in the new order, and the
    permutation (coordinate l was mode perm[l])."""
    perm = torch.argsort(sv, descending=True, stable=True)
    for m in MODALITIES:
        model.heads[m].permute_modes(perm)
    return sv[perm], None if sv_norm is None else sv_norm[perm], perm


def train(cfg: Config, data: TrainData, backbone: Backbone, out_dir: str | Path,
          device=None) -> TrainResult:
    """Train per ``cfg``, checkpointing to out_dir/checkpoint.pt after every epoch and
    resuming from it when it holds an unfinished run of the same config. Runs under DDP
    when torch.distributed is initialised (launch with torchrun; see ``distributed``).

    Epochs 1..cfg.epochs train the heads (and the backbones when cfg.finetune); then
    cfg.head_epochs train the heads alone on the features of the final backbones."""
    out = Path(out_dir)
    ckpt_path = out / "checkpoint.pt"
    device = pick_device(device)
    rank, world = rank_and_world()
    B = min(cfg.batch_size, len(data.sketch_labels))
    if B % world:
        raise ValueError(f"batch size {B} is not divisible by the world size {world}")
    finetune = cfg.finetune
    if finetune and (data.sketch_files is None or data.photo_files is None):
        raise ValueError("finetune=True needs the image files in TrainData")
    total = cfg.epochs + cfg.head_epochs

    torch.manual_seed(cfg.seed)
    heads = {m: Head(backbone.feature_dim, cfg.hidden, cfg.L, cfg.mu) for m in MODALITIES}
    heads["sketch"].set_feature_stats(data.sketch_feats)
    heads["photo"].set_feature_stats(data.photo_feats)
    # the raw coordinates' projections: fit once on the (plain) training features
    raw = (fit_raw_projections(data.sketch_feats, data.photo_feats, cfg.raw_dims,
                               cfg.raw_weight) if cfg.raw_dims else None)
    bbs, splits = None, None
    if finetune:
        if cfg.shared_backbone:
            one = copy.deepcopy(backbone.module)
            bbs = {m: one for m in MODALITIES}
        else:
            bbs = {m: copy.deepcopy(backbone.module) for m in MODALITIES}
        splits = {m: Split(bbs[m], backbone.name, cfg.trainable_stages) for m in MODALITIES}
        for s in splits.values():
            s.freeze()
    model = PairModel(heads, bbs, splits).to(device)

    sampler = PairSampler(data.sketch_labels, data.photo_labels, cfg.pairing, data.photo_of)
    steps = sampler.steps_per_epoch(cfg.batch_size)
    groups = [{"params": list(model.heads.parameters()), "lr": cfg.lr}]
    if bbs is not None:
        groups.append({"params": [p for p in model.backbones.parameters() if p.requires_grad],
                       "lr": cfg.backbone_lr})
    opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    # one scheduler step per optimizer step: the lr reaches 0 at the last step of the phase
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * cfg.epochs)
    m_vec, m_mat = nesting_masks(cfg.L, NESTING_OF[cfg.method], nesting_weights(cfg),
                                 constant_mode=True)

    start, history, sv, sv_norm, head_state = 0, [], None, None, None
    if ckpt_path.is_file():
        ck = load_checkpoint(ckpt_path, map_location="cpu")
        if _comparable(ck["config"]) != _comparable(to_dict(cfg)):
            diff = sorted(k for k in set(ck["config"]) | set(to_dict(cfg))
                          if k not in RUNTIME_FIELDS
                          and ck["config"].get(k) != to_dict(cfg).get(k))
            raise ValueError(f"{ckpt_path} holds a run with a different config ({diff}); "
                             "use another --out")
        for m in MODALITIES:
            model.heads[m].load_state_dict(ck["heads"][m])
            if bbs is not None:
                model.backbones[m].load_state_dict(ck["backbones"][m])
        start, history, sv = ck["epoch"], ck["history"], ck["singular_values"]
        sv_norm = ck.get("singular_values_norm")
        if start < total:
            if ck["train_state"] is None:
                raise ValueError(f"{ckpt_path} has no optimizer state to resume from")
            if start < cfg.epochs:
                opt.load_state_dict(ck["train_state"]["optimizer"])
                sched.load_state_dict(ck["train_state"]["scheduler"])
            else:
                head_state = ck["train_state"]
        log.info("resuming from %s at epoch %d/%d", ckpt_path, start, total)

    inputs = None
    if finetune and start < cfg.epochs:
        # every image decodes before the first step: bad data stops the run, naming the file
        validate_images(data.sketch_files, "checking sketches")
        validate_images(data.photo_files, "checking photos")
        inputs = _Inputs(cfg, data, backbone, splits, device)

    ddp = model
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    use_amp = device.type == "cuda"
    amp_dtype = torch.bfloat16 if use_amp and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)
    feats = {"sketch": data.sketch_feats.to(device), "photo": data.photo_feats.to(device)}
    lo, hi = rank * (B // world), (rank + 1) * (B // world)  # this rank's slice of a batch

    drop_gen = torch.Generator()

    def input_scales():
        """The heads' input dropout factors (mask / keep probability) of this rank's rows,
        per modality: drawn for all B rows of the global batch and sliced like it, so a run
        on W processes equals one on a single process."""
        if cfg.input_dropout == 0:
            return None, None
        keep = 1.0 - cfg.input_dropout
        masks = [torch.rand(B, backbone.feature_dim, generator=drop_gen) < keep
                 for _ in MODALITIES]
        return tuple((m[lo:hi].float() / keep).to(device) for m in masks)

    def step(xs, ys, optimizer, scheduler, module):
        scales = input_scales()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
            f, g = module(xs, ys, scales)  # (B/W, L) each
        if world > 1:
            f, g = gather_rows(f, world, rank), gather_rows(g, world, rank)
        loss = cdk_loss(f.float(), g.float(), m_vec, m_mat)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss * world).backward()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        return loss.item()

    views = None
    if data.sketch_views is not None and data.photo_views is not None and not finetune:
        # (V + 1, N, D): row 0 the plain features the heads are standardised on
        views = {"sketch": torch.cat([feats["sketch"][None], data.sketch_views.to(device)]),
                 "photo": torch.cat([feats["photo"][None], data.photo_views.to(device)])}
    view_gen = torch.Generator()

    def pick_views(s, p):
        """The features of a batch: plain, or one view drawn per image (seeded by the
        step's generator state, so a resumed run draws the same)."""
        s, p = s.to(device), p.to(device)
        if views is None:
            return feats["sketch"][s], feats["photo"][p]
        vs = torch.randint(len(views["sketch"]), (len(s),), generator=view_gen).to(device)
        vp = torch.randint(len(views["photo"]), (len(p),), generator=view_gen).to(device)
        return views["sketch"][vs, s], views["photo"][vp, p]

    def batches(epoch):
        return [(s[lo:hi], p[lo:hi]) for s, p in sampler.epoch(cfg.seed, epoch, cfg.batch_size)]

    head_opt = head_sched = None
    for epoch in range(start, total):
        t0, losses = time.perf_counter(), []
        last = epoch + 1 == total
        torch.manual_seed(cfg.seed * 1_000_003 + epoch)  # dropout/drop-connect: resumable
        view_gen.manual_seed(cfg.seed * 1_000_003 + epoch)
        drop_gen.manual_seed(cfg.seed * 1_000_003 + epoch + 500_009)  # its own stream
        if epoch < cfg.epochs:
            optimizer, scheduler = opt, sched
            _train_mode(model, cfg)
            if finetune:
                for xs, ys in inputs.steps(batches(epoch), epoch):
                    losses.append(step(xs, ys, opt, sched, ddp))
            else:
                for s, p in batches(epoch):
                    xs, ys = pick_views(s, p)
                    losses.append(step(xs, ys, opt, sched, ddp))
            sv, sv_norm, held = _spectrum(model, cfg, feats, inputs, sampler, heldout=last)
        else:
            if head_opt is None:  # entering (or resuming) the head-only phase
                if finetune:
                    if inputs is None:
                        inputs = _Inputs(cfg, data, backbone, splits, device)
                    model.eval()
                    feats = {m: inputs.features(model, m) for m in MODALITIES}
                    inputs = None
                heads_only = PairModel(dict(model.heads), None)
                head_opt = torch.optim.SGD(model.heads.parameters(), lr=cfg.head_lr,
                                           momentum=cfg.momentum,
                                           weight_decay=cfg.weight_decay)
                head_sched = torch.optim.lr_scheduler.CosineAnnealingLR(
                    head_opt, T_max=steps * cfg.head_epochs)
                if head_state is not None:
                    head_opt.load_state_dict(head_state["optimizer"])
                    head_sched.load_state_dict(head_state["scheduler"])
                head_ddp = heads_only
                if world > 1:
                    head_ddp = nn.parallel.DistributedDataParallel(heads_only)
            optimizer, scheduler = head_opt, head_sched
            model.train()
            for s, p in batches(epoch):
                xs, ys = pick_views(s, p)
                losses.append(step(xs, ys, head_opt, head_sched, head_ddp))
            sv, sv_norm, held = _spectrum(model, cfg, feats, None, sampler, heldout=last)
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)),
                        "lr": scheduler.get_last_lr()[0], "seconds": time.perf_counter() - t0,
                        "sigma_top": sv[: min(4, cfg.L)].tolist(),
                        "phase": "all" if epoch < cfg.epochs else "heads"})
        if last:
            # the order as trained, and whether it holds on held-out halves; then (when
            # cfg.sort_modes) the coordinates in the estimated order
            history[-1]["spectrum_order_trained"] = spectrum_order(sv)
            history[-1]["spectrum_order_heldout"] = held
            if cfg.sort_modes:
                sv, sv_norm, perm = _sort_modes(model, sv, sv_norm)
                history[-1]["sorted_from"] = perm.tolist()  # coordinate l was mode perm[l]
        log.info("epoch %d/%d loss %.4f sigma[:4] %s (%.1fs)", epoch + 1, total,
                 history[-1]["loss"], [round(v, 3) for v in history[-1]["sigma_top"]],
                 history[-1]["seconds"])
        if rank == 0:
            save_checkpoint(
                ckpt_path, config=to_dict(cfg), backbone=backbone, image_size=cfg.image_size,
                backbones=dict(model.backbones.items()) if bbs is not None
                else {"sketch": backbone.module, "photo": backbone.module},
                heads=dict(model.heads), singular_values=sv, singular_values_norm=sv_norm,
                raw=raw, trained=True, epoch=epoch + 1,
                finetuned=finetune, history=history,
                train_state=None if last else {"optimizer": optimizer.state_dict(),
                                               "scheduler": scheduler.state_dict()},
            )
        barrier()
    if sv is None:
        if finetune:
            inputs = inputs or _Inputs(cfg, data, backbone, splits, device)
            feats = {m: inputs.features(model, m) for m in MODALITIES}
        sv, sv_norm, _ = _spectrum(model, cfg, feats, None, sampler)
    model.eval()
    final = history[-1] if history else {}
    return TrainResult(dict(model.heads), dict(model.backbones.items()) if bbs is not None
                       else None, sv, history, sv_norm, raw,
                       final.get("spectrum_order_trained"), final.get("spectrum_order_heldout"))
