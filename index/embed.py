"""Photos -> embeddings for the index: training's cached backbone features where they
exist, else the model bundle's photo encoder, with photos decoded in worker processes.

The photo encoder is the bundle's photo graph run by ONNX Runtime on the CPU (in the
precision the bundle chose when it was written, or the one asked for), or on CUDA the
bundle's PyTorch modules. A model trained on photo features averaged with their mirror
image's embeds each photo in one view by default (`views` 1: the bundle's
`photo-single-view` graph, one backbone pass a photo instead of two, for a few thousandths
of mAP: docs/index.md); `views` 2 averages as training did. The index records which
(`Sidecar.photo_views`), and `index.add` follows it.

ONNX Runtime gives each image the same bits whatever batch it is in, so every build path
(local, shards, Ray actors) stores the same vectors for the same photos: they all embed a
gallery slice by slice with `embed_slice`, and the slices are the shards.

Photos whose frozen-backbone features training cached (`training.cdk.features`, the cache
the bundle names) skip the backbone and only go through the photo head
(`cached_features`), which agrees with the encoder within float rounding (tests).

A photo that fails to decode is left out and listed (`Embedded.failed`): one damaged file
does not stop the build of a gallery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from index.gallery import Photo
from training.cdk.features import find_cached
from training.images import ImageError, load_image

__all__ = ["ENCODERS", "PRECISIONS", "VIEWS", "Embedded", "PhotoEncoder", "check_views",
           "feature_cache_dir", "cached_features", "photo_encoder", "embed_photos", "embed_slice"]

log = logging.getLogger(__name__)

ENCODERS = ("auto", "onnx", "torch")
PRECISIONS = ("auto", "fp32", "int8")  # auto: the bundle's choice
VIEWS = (1, 2)  # a photo alone, or averaged with its mirror image (as training did)
HEAD_CHUNK = 4096  # cached feature rows through the head at a time
WORKER_TIMEOUT = 300  # seconds a decoding worker may take to deliver a batch
# (N, 3, H, W) float32 preprocessed images -> (N, width) float32 embeddings
PhotoEncoder = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Embedded:
    """A gallery slice embedded: the vectors (n, width) of `photos` (those that decoded, in
    order), how many came from the feature cache, and the photos left out with the reason."""

    photos: list[Photo]
    vectors: np.ndarray
    from_cache: int
    failed: list[tuple[Photo, str]]


@dataclass(frozen=True)
class FeatureKey:
    """What training.cdk.features keys a backbone's cached features by."""

    name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    flip_average: bool
    pooling: str
    feature_dim: int


def feature_cache_dir(flag: str | None, model) -> str | None:
    """The feature cache the commands read: `flag` (a folder, or "none" for no reuse), by
    default (None) the one the model's training wrote (the bundle records it), if it is
    still there."""
    if flag is not None:
        return None if flag == "none" else flag
    folder = (getattr(model, "training", None) or {}).get("feature_cache") or ""
    return folder if folder and Path(folder).is_dir() else None


def check_views(model, views: int) -> bool:
    """Whether `views` (VIEWS) averages each photo with its mirror image for `model`; a
    ValueError for 2 where the model was trained on photos in one view."""
    if views not in VIEWS:
        raise ValueError(f"photo views must be one of {VIEWS}, got {views!r}")
    if views == 2 and not model.inference.flip_average["photo"]:
        raise ValueError("this model was trained on photos in one view: --photo-views 1")
    return views == 2


def cached_features(model, root: Path, photos: list[Photo], cache_dir: str | Path | None,
                    views: int = 1) -> tuple[list[int], torch.Tensor]:
    """Backbone features of those `photos` that training cached in `cache_dir` for the
    model's photo backbone in `views` (same weights, input size, normalisation and mirror
    averaging; entries whose files changed are never used:
    `training.cdk.features.find_cached`): (positions (K,), features (K, D)). Nothing when
    `cache_dir` is None, nor for a fine-tuned model, whose photos always go through its own
    backbone."""
    inf = model.inference
    mirror = check_views(model, views)
    if cache_dir is None or not photos:
        return [], torch.zeros(0, 0)
    if inf.finetuned:
        log.info("fine-tuned backbone: every photo goes through it, none from %s", cache_dir)
        return [], torch.zeros(0, 0)
    key = FeatureKey(inf.backbone, tuple(inf.mean), tuple(inf.std), mirror, inf.pooling,
                     inf.feature_dim)
    positions, feats = find_cached([root / p.path for p in photos], key,
                                   inf.fingerprints["photo"], inf.size_of("photo"), cache_dir)
    log.info("feature cache %s holds the backbone features of %d of %d photos", cache_dir,
             len(positions), len(photos))
    return positions, feats


class TorchPhotos:
    """The photo side in PyTorch (CUDA), from the bundle's weights."""

    name = "torch"
    precision = "fp32"

    def __init__(self, embedder):
        self.embedder = embedder

    def __call__(self, images: np.ndarray) -> np.ndarray:
        out = self.embedder.encode(torch.from_numpy(images), "photo")
        return np.asarray(out.detach().float().cpu(), dtype=np.float32)


def photo_encoder(model, threads: int = 2, choice: str = "auto", precision: str = "auto",
                  device: str | None = None, views: int = 1) -> PhotoEncoder:
    """The photo encoder of `model` (a Bundle) in `views` (VIEWS): "onnx" (its photo graph
    on the CPU, in `precision`: auto is the bundle's choice), "torch" (its PyTorch modules
    on `device`), or "auto": ONNX Runtime on the CPU, PyTorch on CUDA."""
    mirror = check_views(model, views)
    if choice not in ENCODERS:
        raise ValueError(f"unknown photo encoder {choice!r}; choose one of {', '.join(ENCODERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of "
                         f"{', '.join(PRECISIONS)}")
    on_cuda = torch.device(device).type == "cuda" if device else torch.cuda.is_available()
    if choice == "torch" or (choice == "auto" and on_cuda):
        if precision == "int8":
            raise ValueError("--precision int8 needs the ONNX Runtime photo encoder (--encoder "
                             "onnx, or auto on a CPU); the PyTorch encoder runs in float32")
        return TorchPhotos(model.embedder(device, photo_flip_average=mirror))
    name = model.encoder_name("photo", mirror)
    encoder = model.encoder(name, precision, threads)
    if precision == "auto" and encoder.precision == "fp32":  # say why, and what would help
        log.info("the %s encoder runs in float32: %s", name, model.encoders[name].why)
    return encoder


class PhotoFiles(torch.utils.data.Dataset):
    """Photo files decoded (`load_image`) and preprocessed by `transform`: item i is
    (i, (3, H, W) tensor) or (i, the reason it failed to decode)."""

    def __init__(self, paths: list[Path], transform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | str]:
        try:
            return i, self.transform([load_image(self.paths[i])])[0]  # (3, H, W)
        except ImageError as err:
            return i, str(err)


def _collate(items: list[tuple[int, torch.Tensor | str]]):
    good = [(i, x) for i, x in items if isinstance(x, torch.Tensor)]
    bad = [(i, x) for i, x in items if not isinstance(x, torch.Tensor)]
    batch = torch.stack([x for _, x in good]) if good else None
    return [i for i, _ in good], batch, bad


def embed_photos(
    model,
    root: Path,
    photos: list[Photo],
    encoder: PhotoEncoder | None = None,
    batch_size: int = 32,
    progress: bool = True,
    cached: tuple[list[int], torch.Tensor] | None = None,
    workers: int = 0,
) -> Embedded:
    """Embed photos with the model's photo side: the vectors of those that decode, in order.

    `cached`: (positions, features (K, D)) from `cached_features`; those photos only go
    through the photo head. The others are decoded by `workers` DataLoader processes
    (0: this one) and go through `encoder` (default: the model's photo graph, in the
    bundle's precision) in batches of `batch_size`.
    """
    encoder = encoder or photo_encoder(model, threads=1)
    positions, feats = cached or ([], None)
    width = model.width
    out = np.empty((len(photos), width), dtype=np.float32)
    ok = np.zeros(len(photos), dtype=bool)
    if positions:
        heads = model.embedder("cpu")
        for start in range(0, len(positions), HEAD_CHUNK):
            rows = positions[start : start + HEAD_CHUNK]
            emb = heads.head(feats[start : start + HEAD_CHUNK], "photo")  # (k, width)
            out[rows] = _checked(np.asarray(emb.detach().cpu(), np.float32), len(rows), width)
            ok[rows] = True
    rest = [i for i in range(len(photos)) if not ok[i]]
    workers = workers if rest else 0
    # timeout: a worker that cannot hand its batch over (shared memory full, in a container)
    # is an error naming the wait, not a hang
    loader = DataLoader(PhotoFiles([root / photos[i].path for i in rest],
                                   model.transform("photo")),
                        batch_size=batch_size, num_workers=workers, collate_fn=_collate,
                        timeout=WORKER_TIMEOUT if workers else 0)
    bar = tqdm(total=len(rest), desc="embedding photos", unit="img", disable=not progress)
    failed = []
    for idx, batch, bad in loader:  # in order
        if batch is not None:
            rows = [rest[i] for i in idx]
            out[rows] = _checked(encoder(batch.numpy()), len(rows), width)
            ok[rows] = True
        for i, reason in bad:
            failed.append((photos[rest[i]], reason))
            log.warning("leaving out %s: %s", photos[rest[i]].path, reason)
        bar.update(len(idx) + len(bad))
    bar.close()
    log.info("embedded %d photos from %s: %d from cached backbone features, %d through the "
             "%s encoder (%s), %d failed to decode", int(ok.sum()), root, len(positions),
             len(rest) - len(failed), getattr(encoder, "name", "photo"),
             getattr(encoder, "precision", None) or "unused", len(failed))
    keep = np.flatnonzero(ok)
    return Embedded([photos[i] for i in keep], out[keep] if len(failed) else out,
                    len(positions), failed)


def embed_slice(model, encoder: PhotoEncoder, root: Path, photos: list[Photo],
                cache_dir: str | Path | None, batch_size: int = 32, workers: int = 0,
                progress: bool = False, views: int = 1) -> Embedded:
    """One gallery slice (a shard) embedded as every build path does it (`encoder` in
    `views`, from `photo_encoder`)."""
    cached = cached_features(model, root, photos, cache_dir, views)
    return embed_photos(model, root, photos, encoder, batch_size, progress, cached, workers)


def _checked(emb: np.ndarray, n: int, width: int) -> np.ndarray:
    if emb.shape != (n, width):
        raise ValueError(f"the photo encoder returned shape {emb.shape}, expected {(n, width)}")
    return emb
