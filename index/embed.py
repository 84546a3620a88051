"""Photos -> embeddings for the index: training's cached backbone features where they
exist, else the photo encoder, with photos decoded in worker processes.

The photo encoder is the checkpoint's photo side exported as one ONNX graph and run by ONNX
Runtime (`training.cdk.model.export`, the runtime the service runs sketches on), on the
CPU; on CUDA, or for an embedder that cannot be exported, the PyTorch modules. ONNX Runtime
gives each image the same bits whatever batch it is in, so every build path (local, shards,
Ray actors) stores the same vectors for the same photos: they all embed a gallery slice by
slice with `embed_slice`, and the slices are the shards.

Photos whose frozen-backbone features training cached (`training.cdk.features`, the
checkpoint's `cache_dir`) skip the backbone and only go through the photo head
(`cached_features`), which agrees with the encoder within float rounding (tests).

The ONNX graph runs in float32 or int8 (`precision`): int8 under the service's parity rule,
measured here on the photo side (`training.cdk.model.export.load_or_export`). The graph is
made on first use, so a gallery whose photos all come from the feature cache never waits
for an export or a quantization.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from index.gallery import Photo
from training.cdk.features import find_cached
from training.cdk.model.embedder import Embedder
from training.images import load_image

__all__ = ["ENCODERS", "PRECISIONS", "PhotoEncoder", "feature_cache_dir", "cached_features",
           "photo_encoder", "resolved_precision", "embed_photos", "embed_slice"]

log = logging.getLogger(__name__)

ENCODERS = ("auto", "onnx", "torch")
PRECISIONS = ("auto", "fp32", "int8")  # of the ONNX graph (export.PRECISIONS)
HEAD_CHUNK = 4096  # cached feature rows through the head at a time
# (N, 3, H, W) float32 preprocessed images -> (N, width) float32 embeddings
PhotoEncoder = Callable[[np.ndarray], np.ndarray]
_ONNX: dict[tuple, PhotoEncoder] = {}  # ONNX encoders made by this process, by checkpoint


def feature_cache_dir(flag: str | None, embedder: Embedder) -> str | None:
    """The feature cache the commands read: `flag` (a folder, or "none" for no reuse), by
    default (None) the checkpoint's `cache_dir`, where its training cached its features."""
    folder = (embedder.config.get("cache_dir") or "none") if flag is None else flag
    return None if folder == "none" else folder


def cached_features(
    embedder: Embedder, root: Path, photos: list[Photo], cache_dir: str | Path | None
) -> tuple[list[int], torch.Tensor]:
    """Backbone features of those `photos` that training cached in `cache_dir` for this
    embedder's photo backbone (same weights, input size and normalisation; entries whose
    files changed are never used: `training.cdk.features.find_cached`): (positions (K,),
    features (K, D)). Nothing when `cache_dir` is None, nor for a fine-tuned checkpoint,
    whose photos always go through its own backbone."""
    if cache_dir is None or not photos:
        return [], torch.zeros(0, 0)
    if embedder.finetuned:
        log.info("fine-tuned backbone: every photo goes through it, none from %s", cache_dir)
        return [], torch.zeros(0, 0)
    bb = embedder.backbone_of("photo")
    positions, feats = find_cached([root / p.path for p in photos], bb, bb.module,
                                   embedder.size_of("photo"), cache_dir)
    log.info("feature cache %s holds the backbone features of %d of %d photos", cache_dir,
             len(positions), len(photos))
    return positions, feats


class TorchPhotos:
    """The photo side in PyTorch (CUDA, or embedders that are not exported)."""

    name = "torch"
    precision = "fp32"

    def __init__(self, embedder: Embedder):
        self.embedder = embedder

    def __call__(self, images: np.ndarray) -> np.ndarray:
        out = self.embedder.encode(torch.from_numpy(images), "photo")
        return np.asarray(out.detach().float().cpu(), dtype=np.float32)


class OnnxPhotos:
    """The photo side as an ONNX Runtime graph, made on the first call (or `resolve()`):
    exported once per checkpoint into `folder`/encoders and, for int8, quantized and its
    parity measured there (`load_or_export`). `precision`: the graph's (fp32 or int8) once
    made, None before; `make_seconds`: the time making it took (export, quantization and
    parity, the first time per checkpoint and index folder), not embedding."""

    name = "onnxruntime"

    def __init__(self, embedder: Embedder, folder: str | Path, threads: int, precision: str):
        self.embedder, self.folder, self.threads = embedder, folder, threads
        self.requested = precision
        self._graph = None
        self.make_seconds = 0.0

    def resolve(self):
        if self._graph is None:
            t0 = time.perf_counter()
            e = self.embedder
            key = (e.checkpoint_sha256, e.photo_flip_average, e.sketch_flip_average,
                   self.threads, self.requested)
            if key not in _ONNX:
                from training.cdk.model.export import load_or_export  # onnx only when used

                _ONNX[key] = load_or_export(e, self.folder, threads=self.threads,
                                            modality="photo", precision=self.requested)
            self._graph = _ONNX[key]
            self.make_seconds = time.perf_counter() - t0
        return self._graph

    @property
    def precision(self) -> str | None:
        return None if self._graph is None else self._graph.precision

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return self.resolve()(images)


def _uses_onnx(embedder: Embedder, choice: str, precision: str = "auto") -> bool:
    if choice not in ENCODERS:
        raise ValueError(f"unknown photo encoder {choice!r}; choose one of {', '.join(ENCODERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of "
                         f"{', '.join(PRECISIONS)}")
    exportable = hasattr(embedder, "modules") and torch.device(embedder.device).type == "cpu"
    onnx = choice == "onnx" or (choice == "auto" and exportable)
    if precision == "int8" and not onnx:
        raise ValueError("--precision int8 needs the ONNX Runtime photo encoder (--encoder "
                         "onnx, or auto on a CPU); the PyTorch encoder runs in float32")
    return onnx


def photo_encoder(embedder: Embedder, folder: str | Path, threads: int = 2,
                  choice: str = "auto", precision: str = "auto") -> PhotoEncoder:
    """The photo encoder of `embedder`: "onnx" (`OnnxPhotos`, made on first use), "torch",
    or "auto": ONNX Runtime on the CPU, PyTorch on CUDA and for embedders that cannot be
    exported. `precision` (ONNX only): fp32, int8 (an error when its parity fails), auto
    (int8 where it holds parity and is faster here, the service's rule)."""
    if not _uses_onnx(embedder, choice, precision):
        return TorchPhotos(embedder)
    return OnnxPhotos(embedder, folder, threads, precision)


def resolved_precision(encoder: PhotoEncoder) -> str:
    """The precision `encoder` runs in (fp32 or int8), making an `OnnxPhotos` graph now."""
    return encoder.resolve().precision if isinstance(encoder, OnnxPhotos) else "fp32"


class PhotoFiles(torch.utils.data.Dataset):
    """Photo files decoded (`load_image`: errors name the file) and preprocessed by
    `transform` (`Embedder.transform()`), one (3, H, W) tensor per file, in order."""

    def __init__(self, paths: list[Path], transform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform([load_image(self.paths[i])])[0]  # (3, H, W)


def embed_photos(
    embedder: Embedder,
    root: Path,
    photos: list[Photo],
    encoder: PhotoEncoder | None = None,
    batch_size: int = 32,
    progress: bool = True,
    cached: tuple[list[int], torch.Tensor] | None = None,
    workers: int = 0,
) -> np.ndarray:
    """Embed photos with the checkpoint's photo side: (N, width) float32 in their order.

    `cached`: (positions, features (K, D)) from `cached_features`; those photos only go
    through the photo head. The others are decoded by `workers` DataLoader processes
    (0: this one) and go through `encoder` (default: PyTorch) in batches of `batch_size`.
    """
    encoder = encoder or TorchPhotos(embedder)
    positions, feats = cached or ([], None)
    out = np.empty((len(photos), embedder.width), dtype=np.float32)
    for start in range(0, len(positions), HEAD_CHUNK):
        rows = positions[start : start + HEAD_CHUNK]
        emb = embedder.head(feats[start : start + HEAD_CHUNK], "photo")  # (k, width)
        out[rows] = _checked(np.asarray(emb.detach().cpu(), np.float32), len(rows),
                             embedder.width)
    done = set(positions)
    rest = [i for i in range(len(photos)) if i not in done]
    loader = DataLoader(PhotoFiles([root / photos[i].path for i in rest],
                                   embedder.transform("photo")),
                        batch_size=batch_size, num_workers=workers if rest else 0)
    bar = tqdm(total=len(rest), desc="embedding photos", unit="img", disable=not progress)
    start = 0
    for batch in loader:  # (B, 3, H, W), in order
        rows = rest[start : start + len(batch)]
        out[rows] = _checked(encoder(batch.numpy()), len(rows), embedder.width)
        start += len(rows)
        bar.update(len(rows))
    bar.close()
    log.info("embedded %d photos from %s: %d from cached backbone features, %d through the "
             "%s encoder (%s)", len(photos), root, len(positions), len(rest),
             getattr(encoder, "name", "photo"), getattr(encoder, "precision", None) or "unused")
    return out


def embed_slice(embedder: Embedder, encoder: PhotoEncoder, root: Path, photos: list[Photo],
                cache_dir: str | Path | None, batch_size: int = 32, workers: int = 0,
                progress: bool = False) -> tuple[np.ndarray, int]:
    """One gallery slice (a shard) embedded as every build path does it: (vectors
    (n, width), how many came from the feature cache)."""
    cached = cached_features(embedder, root, photos, cache_dir)
    vectors = embed_photos(embedder, root, photos, encoder, batch_size, progress, cached,
                           workers)
    return vectors, len(cached[0])


def _checked(emb: np.ndarray, n: int, width: int) -> np.ndarray:
    if emb.shape != (n, width):
        raise ValueError(f"the photo encoder returned shape {emb.shape}, expected {(n, width)}")
    return emb
