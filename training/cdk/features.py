"""Backbone feature extraction with an on-disk cache.

A cache entry is keyed by the backbone name, a fingerprint of its weights, the input size
and normalisation, and the exact file list (path, size, mtime), so changed weights or
changed data never reuse stale features.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from training.device import pick_device
from training.files import atomic_save
from training.images import images_to_tensor, load_image

from .backbones import Backbone, weights_fingerprint

__all__ = ["extract_features", "cache_key", "cached_tensor"]

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


def _read_cache(path: Path, key: str, lead: tuple[int, ...], ndim: int) -> torch.Tensor | None:
    """The floats cached at ``path`` (``ndim`` dimensions, the first ones ``lead``), or
    None, with a warning saying why, when the file is unreadable (truncated, empty, not a
    cache), stale, misshapen or not finite: a cache is only ever a shortcut, so a bad one is
    recomputed, never trusted or fatal."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a cache miss
        log.warning("recomputing: feature cache %s is unreadable (%s)", path, err)
        return None
    feats = obj.get("features") if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or obj.get("key") != key:
        log.warning("recomputing: feature cache %s is stale (another key)", path)
    elif not (isinstance(feats, torch.Tensor) and feats.is_floating_point()
              and feats.ndim == ndim and tuple(feats.shape[: len(lead)]) == lead):
        shape = tuple(feats.shape) if isinstance(feats, torch.Tensor) else type(feats).__name__
        log.warning("recomputing: feature cache %s holds %s, not floats of %d dimensions "
                    "starting %s", path, shape, ndim, lead)
    elif not bool(torch.isfinite(feats).all()):
        log.warning("recomputing: feature cache %s holds NaN or infinite values", path)
    else:
        return feats.float()
    return None


def cached_tensor(path: Path | None, key: str, files, lead: tuple[int, ...], ndim: int,
                  compute: Callable[[], torch.Tensor], what: str = "features") -> torch.Tensor:
    """The tensor cached at ``path`` under ``key`` when it is there and sound (see
    _read_cache), else ``compute()``, then written there atomically with the file list.
    ``path`` None: no cache. Every cache of this package (features, trunk activations,
    augmented views) goes through here."""
    if path is not None and path.is_file():
        cached = _read_cache(path, key, lead, ndim)
        if cached is not None:
            log.info("%s from cache %s", what, path)
            return cached
    out = compute()
    if path is not None:
        atomic_save({"key": key, "features": out, "files": [str(f) for f in files]}, path)
        log.info("cached %s %s at %s", what, tuple(out.shape), path)
    return out


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
    key, path = "", None
    if cache_dir is not None:
        key = cache_key(files, backbone, module, image_size)
        path = Path(cache_dir) / f"{backbone.name}-{image_size}-{key[:24]}.pt"
    return cached_tensor(path, key, files, (len(files),), 2, lambda: _compute(
        files, backbone, module, image_size, batch_size, device, desc))
