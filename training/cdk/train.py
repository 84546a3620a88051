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

from training.device import pick_device
from training.images import images_to_tensor, load_image

from ..loss import cdk_loss, nesting_masks, singular_values
from .backbones import Backbone
from .checkpoint import load_checkpoint, save_checkpoint
from .config import NESTING_OF, RUNTIME_FIELDS, Config, nesting_weights, to_dict
from .data import PairSampler
from .distributed import barrier, gather_rows, rank_and_world
from .model import MODALITIES, Head

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


@dataclass
class TrainResult:
    heads: dict[str, Head]
    backbones: dict[str, nn.Module] | None  # fine-tuned backbones, None if frozen
    singular_values: torch.Tensor  # (L,)
    history: list = field(default_factory=list)


class PairModel(nn.Module):
    """(sketch inputs, photo inputs) -> (f (B, L), g (B, L)); inputs are backbone features,
    or images when backbones are given."""

    def __init__(self, heads: dict[str, Head], backbones: dict[str, nn.Module] | None):
        super().__init__()
        self.heads = nn.ModuleDict(heads)
        self.backbones = nn.ModuleDict(backbones) if backbones else None

    def encode(self, x: torch.Tensor, modality: str) -> torch.Tensor:
        if self.backbones is not None:
            x = self.backbones[modality](x)
        return self.heads[modality](x)

    def forward(self, xs: torch.Tensor, ys: torch.Tensor):
        return self.encode(xs, "sketch"), self.encode(ys, "photo")


def _comparable(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in RUNTIME_FIELDS}


@torch.no_grad()
def _spectrum(model: PairModel, data: TrainData, cfg: Config, backbone: Backbone, device):
    """sigma_l = sqrt(E f_l(X)^2 E g_l(Y)^2) on the training set (a seeded subset of at most
    1024 images per modality when the backbones are trained, to bound the cost)."""
    model.eval()
    out = []
    for mod, feats, files in (("sketch", data.sketch_feats, data.sketch_files),
                              ("photo", data.photo_feats, data.photo_files)):
        if model.backbones is None:
            z = torch.cat([model.encode(feats[i : i + 8192].to(device), mod)
                           for i in range(0, len(feats), 8192)])
        else:
            g = torch.Generator().manual_seed(cfg.seed)
            idx = torch.randperm(len(files), generator=g)[:1024].tolist()
            z = torch.cat([model.encode(_images([files[j] for j in idx[i : i + 64]], cfg,
                                                backbone, device), mod)
                           for i in range(0, len(idx), 64)])
        out.append(z.float())
    model.train()
    return singular_values(out[0], out[1]).float().cpu()


def _images(files, cfg: Config, backbone: Backbone, device) -> torch.Tensor:
    ims = [load_image(f) for f in files]
    return images_to_tensor(ims, cfg.image_size, backbone.mean, backbone.std).to(device)


def train(cfg: Config, data: TrainData, backbone: Backbone, out_dir: str | Path,
          device=None) -> TrainResult:
    """Train per ``cfg``, checkpointing to out_dir/checkpoint.pt after every epoch and
    resuming from it when it holds an unfinished run of the same config. Runs under DDP
    when torch.distributed is initialised (launch with torchrun; see ``distributed``)."""
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

    torch.manual_seed(cfg.seed)
    heads = {m: Head(backbone.feature_dim, cfg.hidden, cfg.L, cfg.mu) for m in MODALITIES}
    heads["sketch"].set_feature_stats(data.sketch_feats)
    heads["photo"].set_feature_stats(data.photo_feats)
    bbs = {m: copy.deepcopy(backbone.module) for m in MODALITIES} if finetune else None
    model = PairModel(heads, bbs).to(device)
    if bbs is not None:
        for m in bbs.values():
            m.eval()  # BN statistics stay those of the pretrained network

    sampler = PairSampler(data.sketch_labels, data.photo_labels, cfg.pairing, data.photo_of)
    steps = sampler.steps_per_epoch(cfg.batch_size)
    groups = [{"params": list(model.heads.parameters()), "lr": cfg.lr}]
    if bbs is not None:
        groups.append({"params": list(model.backbones.parameters()), "lr": cfg.backbone_lr})
    opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    # one scheduler step per optimizer step: the lr reaches 0 at the last step of the run
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * cfg.epochs)
    m_vec, m_mat = nesting_masks(cfg.L, NESTING_OF[cfg.method], nesting_weights(cfg),
                                 constant_mode=True)

    start, history, sv = 0, [], None
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
        if start < cfg.epochs:
            if ck["train_state"] is None:
                raise ValueError(f"{ckpt_path} has no optimizer state to resume from")
            opt.load_state_dict(ck["train_state"]["optimizer"])
            sched.load_state_dict(ck["train_state"]["scheduler"])
        log.info("resuming from %s at epoch %d/%d", ckpt_path, start, cfg.epochs)

    ddp = model
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    use_amp = device.type == "cuda"
    amp_dtype = torch.bfloat16 if use_amp and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)
    sk_feats, ph_feats = data.sketch_feats.to(device), data.photo_feats.to(device)
    lo, hi = rank * (B // world), (rank + 1) * (B // world)  # this rank's slice of a batch

    for epoch in range(start, cfg.epochs):
        t0, losses = time.perf_counter(), []
        model.train()
        for s_idx, p_idx in sampler.epoch(cfg.seed, epoch, cfg.batch_size):
            s_idx, p_idx = s_idx[lo:hi], p_idx[lo:hi]
            if finetune:
                xs = _images([data.sketch_files[i] for i in s_idx], cfg, backbone, device)
                ys = _images([data.photo_files[i] for i in p_idx], cfg, backbone, device)
            else:
                xs, ys = sk_feats[s_idx.to(device)], ph_feats[p_idx.to(device)]
            with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
                f, g = ddp(xs, ys)  # (B/W, L) each
            if world > 1:
                f, g = gather_rows(f, world, rank), gather_rows(g, world, rank)
            loss = cdk_loss(f.float(), g.float(), m_vec, m_mat)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss * world).backward()
            if cfg.grad_clip > 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
        sv = _spectrum(model, data, cfg, backbone, device)
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)),
                        "lr": sched.get_last_lr()[0], "seconds": time.perf_counter() - t0,
                        "sigma_top": sv[: min(4, cfg.L)].tolist()})
        log.info("epoch %d/%d loss %.4f sigma[:4] %s (%.1fs)", epoch + 1, cfg.epochs,
                 history[-1]["loss"], [round(v, 3) for v in history[-1]["sigma_top"]],
                 history[-1]["seconds"])
        if rank == 0:
            last = epoch + 1 == cfg.epochs
            save_checkpoint(
                ckpt_path, config=to_dict(cfg), backbone=backbone, image_size=cfg.image_size,
                backbones=dict(model.backbones) if bbs is not None
                else {"sketch": backbone.module, "photo": backbone.module},
                heads=dict(model.heads), singular_values=sv, trained=True, epoch=epoch + 1,
                finetuned=finetune, history=history,
                train_state=None if last else {"optimizer": opt.state_dict(),
                                               "scheduler": sched.state_dict()},
            )
        barrier()
    if sv is None:
        sv = _spectrum(model, data, cfg, backbone, device)
    model.eval()
    return TrainResult(dict(model.heads), dict(model.backbones) if bbs is not None else None,
                       sv, history)
