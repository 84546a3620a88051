"""Backbone feature extraction with an on-disk cache.

A cache entry is keyed by the backbone name, a fingerprint of its weights, the input size
and normalisation, and the exact file list (path, size, mtime), so changed weights or
changed data never reuse stale features.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from training.device import pick_device
from training.files import atomic_save
from training.images import images_to_tensor, load_image

from .backbones import Backbone, weights_fingerprint

__all__ = ["extract_features", "cache_key"]

log = logging.getLogger(__name__)
_VERSION = 2  # bump when preprocessing changes (2: EXIF orientation, 16-bit scaling)


def cache_key(files, backbone: Backbone, module: torch.nn.Module, image_size: int) -> str:
    h = hashlib.sha256()
    head = {"v": _VERSION, "name": backbone.name, "weights": weights_fingerprint(module),
            "size": image_size, "mean": backbone.mean, "std": backbone.std}
    h.update(json.dumps(head, sort_keys=True).encode())
    for f in files:
        st = Path(f).stat()
        h.update(f"{Path(f).resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@torch.no_grad()
def _compute(files, backbone, module, image_size, batch_size, device, desc) -> torch.Tensor:
    module = module.to(device).eval()
    out = []
    for i in tqdm(range(0, len(files), batch_size), desc=desc, unit="batch", leave=False):
        ims = [load_image(f) for f in files[i : i + batch_size]]  # ImageError names the file
        x = images_to_tensor(ims, image_size, backbone.mean, backbone.std).to(device)
        with torch.autocast(device.type, enabled=device.type == "cuda"):
            out.append(module(x).float().cpu())
    return torch.cat(out)  # (N, D)


def extract_features(
    files,
    backbone: Backbone,
    image_size: int,
    cache_dir: str | Path | None,
    module: torch.nn.Module | None = None,
    batch_size: int = 64,
    device=None,
    desc: str = "features",
) -> torch.Tensor:
    """(N, D) float32 pooled features of ``files`` with ``module`` (default: the backbone's),
    read from / written to ``cache_dir`` (None disables the cache)."""
    files = [Path(f) for f in files]
    module = backbone.module if module is None else module
    device = pick_device(device)
    if not files:
        return torch.zeros(0, backbone.feature_dim)
    path = None
    if cache_dir is not None:
        key = cache_key(files, backbone, module, image_size)
        path = Path(cache_dir) / f"{backbone.name}-{image_size}-{key[:24]}.pt"
        if path.is_file():
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if obj.get("key") == key and obj["features"].shape[0] == len(files):
                log.info("features from cache %s", path)
                return obj["features"]
            log.warning("ignoring stale feature cache %s", path)
    feats = _compute(files, backbone, module, image_size, batch_size, device, desc)
    if path is not None:
        atomic_save({"key": key, "features": feats, "files": [str(f) for f in files]}, path)
        log.info("cached %d features at %s", len(files), path)
    return feats
