"""Adapting trained heads to a gallery of photos whose classes are unknown.

A gallery's photos are there before any query. Each has pseudo-sketches
(training.cdk.pseudo), and a pseudo-sketch paired with its own photo is an instance pair
of the gallery: no label, no drawn sketch. ``adapt_heads`` goes on training the two heads
by the same NestedLoRA loss on the canonical dependence kernel of a mixture: a share
``gallery_share`` of each batch are such pairs, the rest pairs of the training set drawn
as training drew them (its sampler), so what the heads learned from real sketches is kept
while they learn to meet the gallery's photos. A batch of the two kinds of rows is a sample
of the mixture p = (1 - a) p_train + a p_gallery, so the loss is that mixture's.

The heads' input standardisation and the raw coordinates stay those of training; only the
MLPs move. The modes keep their order (no spectrum pass: the training kernel's order is
what a d-prefix was chosen by).

    adapted = adapt_heads(res.heads, train_feats, sampler, view_feats, gallery_feats,
                          view_photo, Adaptation(), weights)
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..loss import cdk_loss, nesting_masks
from .model.heads import Head

__all__ = ["Adaptation", "adapt_heads"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adaptation:
    """steps of SGD (momentum, cosine lr to 0 over the steps, weight decay, gradient norm
    clipped) on batches of ``batch_size`` pairs, ``gallery_share`` of them pseudo-sketch
    pairs of the gallery; input dropout of the heads' standardised features as in training;
    ``seed`` fixes the batches and the dropout."""

    steps: int = 300
    batch_size: int = 512
    gallery_share: float = 0.5
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-3
    grad_clip: float = 1.0
    input_dropout: float = 0.3
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 4:
            raise ValueError(f"steps must be >= 1 and batch_size >= 4, got {self.steps}, "
                             f"{self.batch_size}")
        if not 0 < self.gallery_share < 1:
            raise ValueError(f"gallery_share must be in (0, 1), got {self.gallery_share!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not 0 <= self.input_dropout < 1:
            raise ValueError(f"input_dropout must be in [0, 1), got {self.input_dropout!r}")


def _training_batches(sampler, seed: int, batch: int):
    """Endless (sketch idx, photo idx) batches of ``batch`` training pairs from ``sampler``
    (data.PairSampler's interface), epoch after epoch."""
    epoch = 0
    while True:
        yield from sampler.epoch(seed, epoch, batch)
        epoch += 1


def adapt_heads(heads: dict[str, Head], train_feats: tuple[torch.Tensor, torch.Tensor],
                sampler, view_feats: torch.Tensor, gallery_feats: torch.Tensor,
                view_photo: torch.Tensor, cfg: Adaptation,
                weights: torch.Tensor | None = None) -> dict[str, Head]:
    """Copies of the trained ``heads`` ({"sketch", "photo"}) adapted to a gallery.

    train_feats: the training sketches' and photos' backbone features ((Ns, D), (Np, D)),
    the rows ``sampler`` draws pairs of (its ``epoch(seed, epoch, batch)``); view_feats (M, D)
    the features of pseudo-sketches of the gallery's photos, gallery_feats (P, D) those
    photos' features, view_photo (M,) the photo of each view; weights: the joint-nesting
    weights (modes,) the heads were trained with (None: uniform). The input heads are not
    changed."""
    sketch_feats, photo_feats = train_feats
    view_photo = torch.as_tensor(view_photo, dtype=torch.long)
    if len(view_feats) != len(view_photo) or len(view_feats) == 0:
        raise ValueError(f"view_photo must give each of the {len(view_feats)} views (at "
                         f"least one) its photo, got {len(view_photo)}")
    if not 0 <= int(view_photo.min()) <= int(view_photo.max()) < len(gallery_feats):
        raise ValueError(f"view_photo must index the {len(gallery_feats)} gallery photos")
    out = {m: copy.deepcopy(h).cpu().train() for m, h in heads.items()}
    modes = out["sketch"].modes
    masks = nesting_masks(modes, "joint", weights, constant_mode=True)
    params = [p for h in out.values() for p in h.parameters()]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps)
    n_view = max(2, round(cfg.batch_size * cfg.gallery_share))
    n_train = max(2, cfg.batch_size - n_view)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7)
    batches = _training_batches(sampler, cfg.seed, n_train)
    width = sketch_feats.shape[1]
    losses = []
    for _ in range(cfg.steps):
        s, p = next(batches)
        v = torch.randint(len(view_feats), (n_view,), generator=gen)
        xs = torch.cat([sketch_feats[s], view_feats[v]]).float()  # (B, D)
        ys = torch.cat([photo_feats[p], gallery_feats[view_photo[v]]]).float()
        scales = [None, None]
        if cfg.input_dropout:
            keep = 1.0 - cfg.input_dropout
            scales = [(torch.rand(len(xs), width, generator=gen) < keep).float() / keep
                      for _ in range(2)]
        f = out["sketch"](xs, scales[0])
        g = out["photo"](ys, scales[1])
        loss = cdk_loss(f, g, *masks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    log.info("adapted the heads to %d gallery views: %d steps, loss %.4f -> %.4f",
             len(view_feats), cfg.steps, losses[0], losses[-1])
    return {m: h.eval() for m, h in out.items()}
