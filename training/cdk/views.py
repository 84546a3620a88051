"""Features of augmented views for the frozen-backbone path: V random views of every
training image (the fine-tuning path's augmentation, seeded per image and view), run
through the frozen backbone once and cached on disk beside the plain features, so the heads
see a different view of an image from epoch to epoch at no cost per step."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from training.device import pick_device
from training.files import atomic_save

from .backbones import Backbone
from .features import cache_key, read_cache
from .finetune import StepImages

__all__ = ["view_features"]

log = logging.getLogger(__name__)


@torch.no_grad()
def view_features(files, modality: int, backbone: Backbone, image_size: int, views: int,
                  seed: int, cache_dir: str | Path | None, batch_size: int = 64, device=None,
                  desc: str = "views") -> torch.Tensor:
    """(views, N, D) pooled features of augmented views of ``files`` (modality 0: sketches,
    1: photos, which picks the augmentation); view v of image i is StepImages' item
    (modality, i, epoch=v), so it does not depend on batch size or cache state."""
    files = [Path(f) for f in files]
    device = pick_device(device)
    path = None
    if cache_dir is not None:
        key = cache_key(files, backbone, backbone.module, image_size) + \
            f"|views-{views}-seed{seed}-mod{modality}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"{backbone.name}-{image_size}-views{views}-{digest}.pt"
        if path.is_file():
            cached = read_cache(path, key, views, ndim=3)
            if cached is not None and cached.shape[1] == len(files):
                log.info("view features from cache %s", path)
                return cached
    pair = [files, files]  # StepImages indexes (sketch files, photo files) by modality
    images = StepImages(pair[0], pair[1], image_size, backbone.mean, backbone.std,
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
    if path is not None:
        atomic_save({"key": key, "features": out, "files": [str(f) for f in files]}, path)
        log.info("cached %d x %d view features at %s", views, len(files), path)
    return out
