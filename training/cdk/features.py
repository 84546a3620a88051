"""Backbone feature extraction with an on-disk cache.

A cache entry is keyed by the backbone name, a fingerprint of its weights, the input size
and normalisation, and the exact file list (path, size, mtime), so changed weights or
changed data never reuse stale features.

Features averaged with the mirror image's are computed as the two views' mean, and the
first view's features, computed anyway, are cached too under the one-view key: an index
that embeds photos in one view (index.embed) reads them instead of running the backbone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from training.device import pick_device
from training.files import atomic_save, atomic_write_bytes
from training.images import images_to_tensor, load_image

from .model.backbones import Backbone, PooledFeatures, weights_fingerprint

__all__ = ["ONNX_MIN_IMAGES", "backbone_graph", "cache_entry", "cache_key", "cached_tensor",
           "extract_features", "find_cached", "one_view"]

log = logging.getLogger(__name__)
_VERSION = 2  # bump when preprocessing changes (2: EXIF orientation, 16-bit scaling)


def cache_key(files, backbone: Backbone, module: torch.nn.Module | None, image_size: int,
              fingerprint: str | None = None) -> str:
    """The key of ``files``' features: ``fingerprint`` is ``weights_fingerprint(module)``,
    given when it is already known (find_cached: from the model bundle, no module built)."""
    h = hashlib.sha256()
    weights = weights_fingerprint(module) if fingerprint is None else fingerprint
    head = {"v": _VERSION, "name": backbone.name, "weights": weights,
            "size": image_size, "mean": backbone.mean, "std": backbone.std}
    if backbone.flip_average:  # absent otherwise: the keys of earlier caches still hold
        head["flip_average"] = True
    if backbone.pooling != "avg":  # likewise
        head["pooling"] = backbone.pooling
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


# On the CPU, at least this many images go through the backbone's ONNX Runtime graph
# (exported once per weights, input side and pooling, and kept in the cache folder), which
# computes the same features 2-4x faster than PyTorch's eager kernels; fewer do not pay for
# the export (seconds).
ONNX_MIN_IMAGES = 200


def backbone_graph(backbone: Backbone, module: torch.nn.Module, image_size: int,
                   cache_dir: str | Path | None, threads: int) -> Callable:
    """`module` (the backbone's pooled features) as an ONNX Runtime graph on the CPU:
    (N, 3, S, S) float32 -> (N, D) float32. Exported once and kept in `cache_dir` under the
    weights' fingerprint (the file is re-exported when it cannot be read)."""
    from .model.export import export_module, session

    fingerprint = weights_fingerprint(module)
    tag = "-flip" if getattr(module, "flip_average", False) else ""
    name = (f"{backbone.name}-{image_size}-{getattr(module, 'pooling', 'avg')}{tag}-"
            f"{fingerprint[:24]}.onnx")
    path = None if cache_dir is None else Path(cache_dir) / "graphs" / name
    run = None
    if path is not None and path.is_file():
        try:
            run = session(path.read_bytes(), threads, str(path))
        except ValueError as err:  # a damaged file is only a cache miss
            log.warning("exporting again: %s", err)
    if run is None:
        log.info("exporting the %s backbone at %d px to ONNX (once per weights)", backbone.name,
                 image_size)
        data = export_module(module, image_size, {"backbone": backbone.name,
                                                  "fingerprint": fingerprint})
        if path is not None:
            atomic_write_bytes(data, path)
        run = session(data, threads, "backbone graph")
    return lambda x: run.run(None, {"images": np.ascontiguousarray(x, np.float32)})[0]


def one_view(module: torch.nn.Module) -> PooledFeatures | None:
    """The same trunk pooled without the mirror average, for a module that averages (its
    first view alone, what an index in one view embeds); None otherwise."""
    if isinstance(module, PooledFeatures) and module.flip_average:
        return PooledFeatures(module.trunk, False, module.pooling)
    return None


@torch.no_grad()
def _compute(files, backbone, module, one, image_size, batch_size, device, desc,
             cache_dir=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, D) features of ``files`` and, for a mirror-averaging ``module`` (``one``: its
    one_view), (N, D) those of the first view alone (else None): the two views go through
    the one-view network, whose ONNX graph the sketches of the same weights share."""
    module = module.to(device).eval()
    net = module if one is None else one.eval()
    if device.type == "cpu" and len(files) >= ONNX_MIN_IMAGES:
        graph = backbone_graph(backbone, net, image_size, cache_dir, torch.get_num_threads())
        forward = lambda x: torch.from_numpy(graph(x.numpy()))  # noqa: E731
    else:
        forward = net
    out, first = [], []
    for i in tqdm(range(0, len(files), batch_size), desc=desc, unit="batch", leave=False):
        ims = [load_image(f) for f in files[i : i + batch_size]]  # ImageError names the file
        x = images_to_tensor(ims, image_size, backbone.mean, backbone.std).to(device)
        with torch.autocast(device.type, enabled=device.type == "cuda"):
            a = forward(x).float().cpu()
            if one is not None:
                first.append(a)
                a = torch.stack([a, forward(x.flip(3)).float().cpu()]).mean(0)
        out.append(a)
    return torch.cat(out), (torch.cat(first) if first else None)  # (N, D) each


def cache_entry(files, backbone: Backbone, module: torch.nn.Module, image_size: int,
                cache_dir: str | Path | None) -> tuple[str, Path | None]:
    """(key, file) of the cache entry that holds (or will hold) ``files``' features;
    ("", None) without a cache."""
    if cache_dir is None:
        return "", None
    key = cache_key([Path(f) for f in files], backbone, module, image_size)
    return key, Path(cache_dir) / f"{backbone.name}-{image_size}-{key[:24]}.pt"


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
    key, path = cache_entry(files, backbone, module, image_size, cache_dir)
    one = one_view(module)

    def compute() -> torch.Tensor:
        feats, first = _compute(files, backbone, module, one, image_size, batch_size, device,
                                desc, cache_dir)
        if first is not None and cache_dir is not None:  # the first view, computed anyway
            bb = dataclasses.replace(backbone, module=one)
            k1, p1 = cache_entry(files, bb, one, image_size, cache_dir)
            atomic_save({"key": k1, "features": first, "files": [str(f) for f in files]}, p1)
            log.info("cached the first view's features %s at %s", tuple(first.shape), p1)
        return feats

    return cached_tensor(path, key, files, (len(files),), 2, compute)


def find_cached(files, backbone, fingerprint: str, image_size: int,
                cache_dir: str | Path) -> tuple[list[int], torch.Tensor]:
    """The features of those ``files`` that entries of ``cache_dir`` written by
    extract_features hold, whatever file lists the entries were written for (training
    caches one list per split and modality): (positions in ``files`` (K,), features (K, D)).

    ``backbone``: what a Backbone says of itself (name, mean, std, flip_average, pooling,
    feature_dim; no module needed), ``fingerprint``: its weights' (weights_fingerprint).
    An entry is used only when its key, recomputed with cache_key from its own stored file
    list (today's sizes and mtimes) and those weights, equals its stored key: an
    entry of other weights, size or normalisation, or with any of its files changed, moved
    or removed since it was written, gives nothing. Unreadable or unsound entries are
    skipped with a warning. Tensors are memory mapped: only the rows used are read."""
    want: dict[Path, list[int]] = {}
    for i, f in enumerate(files):
        want.setdefault(Path(f).resolve(), []).append(i)
    found: dict[int, torch.Tensor] = {}
    # the names extract_features gives its entries (not those of views or trunk caches)
    name = re.compile(re.escape(f"{backbone.name}-{image_size}-") + r"[0-9a-f]{24}\.pt")
    entries = sorted(p for p in Path(cache_dir).glob("*.pt") if name.fullmatch(p.name))
    for path in entries:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            stored = [Path(f) for f in obj["files"]]
            rows = {i: r for r, f in enumerate(stored) for i in want.get(f.resolve(), ())
                    if i not in found}
            if not rows:
                continue
            current = cache_key(stored, backbone, None, image_size, fingerprint)
        except Exception as err:  # noqa: BLE001 - a cache is only a shortcut
            log.warning("not using feature cache %s: %s: %s", path, type(err).__name__, err)
            continue
        feats = obj.get("features")
        if obj.get("key") != current:
            log.info("not using feature cache %s: other weights, or its files changed", path)
        elif not (isinstance(feats, torch.Tensor) and feats.is_floating_point()
                  and tuple(feats.shape) == (len(stored), backbone.feature_dim)):
            log.warning("not using feature cache %s: it holds %s, not (%d, %d) floats", path,
                        getattr(feats, "shape", type(feats).__name__), len(stored),
                        backbone.feature_dim)
        else:
            rows_used = feats[list(rows.values())].float()  # (k, D)
            if bool(torch.isfinite(rows_used).all()):
                found.update(zip(rows, rows_used, strict=True))
            else:
                log.warning("not using feature cache %s: NaN or infinite values", path)
    positions = sorted(found)
    if not positions:
        return [], torch.zeros(0, backbone.feature_dim)
    return positions, torch.stack([found[i] for i in positions])
