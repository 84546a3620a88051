"""Features of augmented views for the frozen-backbone path: V random views of every
training image (the fine-tuning path's augmentation, seeded per image and view), run
through the frozen backbone once and cached on disk beside the plain features, so the heads
see a different view of an image from epoch to epoch at no cost per step."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from tqdm import tqdm

from training.device import pick_device

from .features import cache_key, cached_tensor
from .finetune import StepImages
from .model.backbones import Backbone

__all__ = ["view_features"]


def view_features(files, modality: int, backbone: Backbone, image_size: int, views: int,
                  seed: int, cache_dir: str | Path | None, batch_size: int = 64, device=None,
                  desc: str = "views") -> torch.Tensor:
    """(views, N, D) pooled features of augmented views of ``files`` (modality 0: sketches,
    1: photos, which picks the augmentation); view v of image i is StepImages' item
    (modality, i, epoch=v), so it does not depend on batch size or cache state."""
    files = [Path(f) for f in files]
    device = pick_device(device)
    key, path = "", None
    if cache_dir is not None:
        key = cache_key(files, backbone, backbone.module, image_size) + \
            f"|views-{views}-seed{seed}-mod{modality}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"{backbone.name}-{image_size}-views{views}-{digest}.pt"

    @torch.no_grad()
    def compute() -> torch.Tensor:
        # both file lists are ``files``: StepImages picks the augmentation by ``modality``
        images = StepImages(files, files, image_size, backbone.mean, backbone.std,
                            augment=True, seed=seed)
        module = backbone.module.to(device).eval()
        out = torch.empty(views, len(files), backbone.feature_dim)
        for v in range(views):
            for i in tqdm(range(0, len(files), batch_size), desc=f"{desc} {v + 1}/{views}",
                          unit="batch", leave=False):
                idx = range(i, min(i + batch_size, len(files)))
                x = torch.stack([images[(modality, j, v)] for j in idx]).to(device)
                with torch.autocast(device.type, enabled=device.type == "cuda"):
                    out[v, idx.start : idx.stop] = module(x).float().cpu()
        return out

    return cached_tensor(path, key, files, (views, len(files)), 3, compute,
                         what="view features")
