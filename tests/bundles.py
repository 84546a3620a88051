"""Models for tests and benchmark smoke runs, made in seconds: an untrained but complete
training checkpoint (real pretrained backbone weights, seeded random heads), and the model
bundle written from it (training.cdk.make_bundle: float32 graphs only, no training data to
calibrate int8 on unless one is given)."""

from __future__ import annotations

from pathlib import Path

import torch

from training.cdk.checkpoint import save_checkpoint
from training.cdk.config import make_config, to_dict
from training.cdk.model.backbones import build_backbone
from training.cdk.model.heads import MODALITIES, Head, RawProjection


def init_checkpoint(
    path: str | Path,
    backbone: str = "efficientnet-lite0",
    modes: int = 16,
    hidden: int = 64,
    seed: int = 0,
    backbone_weights: str | None = None,
    image_size: int = 224,
    photo_flip_average: bool = True,
    pooling: str = "gem",
    sketch_flip_average: bool | None = None,
    raw_dims: int | None = None,
    sketch_image_size: int = 0,
) -> Path:
    """Write a complete but untrained checkpoint in seconds: real pretrained backbone
    weights, randomly initialised heads (seeded), singular values set to ones, and
    ``trained: False`` (also ``config["untrained"] = True``). For tests of loaders.
    ``sketch_flip_average`` None: sketches are mirror-averaged as photos are;
    ``raw_dims`` None: the preset's raw coordinates (a seeded random projection);
    ``sketch_image_size`` 0: ``image_size``."""
    if sketch_flip_average is None:
        sketch_flip_average = photo_flip_average
    cfg = make_config(
        "cpu", backbone=backbone, modes=modes, hidden=hidden, seed=seed,
        backbone_weights=backbone_weights or "", image_size=image_size,
        sketch_image_size=sketch_image_size, photo_flip_average=photo_flip_average, pooling=pooling,
        sketch_flip_average=sketch_flip_average,
        **({} if raw_dims is None else {"raw_dims": raw_dims}),
    )
    bb = build_backbone(backbone, backbone_weights, cfg.photo_flip_average, cfg.pooling)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        heads = {m: Head(bb.feature_dim, hidden, modes, cfg.mu) for m in MODALITIES}
        raw = None
        if cfg.raw_dims:  # seeded orthonormal axes and random means
            axes = torch.linalg.qr(torch.randn(bb.feature_dim, cfg.raw_dims))[0]
            raw = {m: RawProjection(torch.rand(bb.feature_dim), axes, cfg.raw_weight)
                   for m in MODALITIES}
    finally:
        torch.random.set_rng_state(gen_state)
    return save_checkpoint(
        path,
        config={**to_dict(cfg), "untrained": True},
        backbone=bb,
        image_size=image_size,
        backbones={"sketch": bb.module, "photo": bb.module},
        heads=heads,
        singular_values=torch.ones(modes),
        raw=raw,
        trained=False,
        epoch=0,
    )


def untrained_bundle(folder: str | Path, data: str | Path | None = None, split: str = "sketchy2",
                     **kwargs):
    """``init_checkpoint(folder / "checkpoint.pt", **kwargs)`` written as the model bundle
    ``folder / "model"`` and opened (a Bundle). ``data``: the training data its config names
    (under the class split ``split``), to calibrate int8 on; None: float32 graphs only."""
    from training.cdk.make_bundle import make_bundle

    folder = Path(folder)
    ckpt = init_checkpoint(folder / "checkpoint.pt", **kwargs)
    if data is not None:
        obj = torch.load(ckpt, weights_only=True)
        obj["config"] = {**obj["config"], "data": str(data), "split": split}
        torch.save(obj, ckpt)
    return make_bundle(ckpt, folder / "model", threads=1)
