"""Retrieval: sketch images -> sketch embeddings (d-prefix) -> top-k gallery photos.

Plain domain code, no HTTP: the routes call it and turn its errors into status codes. The
number of retrievals computing at once is bounded by the caller (the routes' inference
slots), not here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image

from index.store import GalleryIndex, IndexCorruptError
from service.encoders import Encoder, TorchEncoder
from service.galleries import GalleryHolder
from service.photo_files import UnknownPhotoError, read_photo
from training.cdk.model.smoothing import RESCORE, Expansion, expanded_search
from training.images import decode_image

log = logging.getLogger(__name__)

SKETCH_FORMATS = ("PNG", "JPEG", "WEBP")  # what the web page and API clients may upload

__all__ = ["DimsError", "Hit", "RetrievalEngine", "SKETCH_FORMATS", "Timings",
           "UnknownPhotoError"]


class DimsError(ValueError):
    pass


@dataclass(frozen=True)
class Hit:
    id: str
    cls: str  # "" for a photo without a class
    score: float
    path: str  # the photo's path in its gallery (for display)


@dataclass
class Timings:
    """Seconds spent in each stage of one request (all queries of a batch together)."""

    decode: float = 0.0
    preprocess: float = 0.0
    encode: float = 0.0  # backbone and head (one graph in ONNX Runtime)
    search: float = 0.0

    STAGES = ("decode", "preprocess", "encode", "search")

    def header(self) -> str:
        """A `Server-Timing` header value (milliseconds)."""
        return ", ".join(f"{s};dur={1000 * getattr(self, s):.2f}" for s in self.STAGES)


def check_width(model, gallery: GalleryIndex) -> None:
    """The model's embeddings and the index's vectors must be equally wide."""
    if model.width != gallery.sidecar.width:
        raise IndexCorruptError(
            f"the model's embeddings are {model.width} wide but the index was "
            f"built from embeddings {gallery.sidecar.width} wide"
        )


class RetrievalEngine:
    """A model's sketch encoder and the gallery being served (swappable, see `galleries`).

    `model` embeds nothing here but gives the sketches' preprocessing (a Bundle); `encoder`
    runs them (default: the model's PyTorch modules). Photos are served from `photos_root`
    (None: the folder the first version's sidecar names); versions that name another photo
    folder are refused on reload, so the folder is fixed for the life of the process."""

    def __init__(self, model, gallery: GalleryIndex, max_pixels: int,
                 photos_root: Path | None = None, decode_side: int | None = None,
                 embed_batch: int = 16, encoder: Encoder | None = None,
                 version: str | None = None, expansion: Expansion | None = None,
                 expand_rescore: int = RESCORE, sketch_flip_average: bool = False):
        check_width(model, gallery)
        self.model = model
        self.galleries = GalleryHolder(gallery, version)
        self.max_pixels = max_pixels
        self.photos_root = Path(photos_root or gallery.sidecar.photos_root)
        # what every later version must name (service.reload)
        self.recorded_root = gallery.sidecar.photos_root
        self.sketch_flip_average = sketch_flip_average
        # Uploads are shrunk while decoding to keep both sides >= decode_side (None: not
        # shrunk); the model resizes them to its input size anyway.
        self.decode_side = decode_side
        self.embed_batch = embed_batch
        # Sketches are embedded by `encoder` (ONNX Runtime on the CPU, service.encoders);
        # the photo side is never run here: photos are embedded by index.build.
        self.encoder = encoder or TorchEncoder(model.embedder("cpu"))
        # Each query expanded with its best photos before the search that answers it
        # (training.cdk.model.smoothing.Expansion; the model's, or the settings').
        self.expansion = expansion or Expansion(n=0)
        # ... and a pool of at least max(100, expand_rescore x k) candidates (the index
        # kind's) re-scored by the expanded query (0: a second search of the whole index;
        # expanded_search)
        self.expand_rescore = expand_rescore

    @property
    def gallery(self) -> GalleryIndex:
        """The gallery now current (a request leases it instead: `galleries.lease()`)."""
        return self.galleries.current()[0]

    @property
    def dims(self) -> int:
        """Largest servable d: the stored prefix length."""
        return self.gallery.dims

    def _embed(self, images: list, dims: int, timings: Timings) -> np.ndarray:
        # Forwards of at most embed_batch images: backbone activations grow with the batch
        # (about 185 MB for 16 sketches at 224 px on CPU), and a slot's memory must not.
        return np.concatenate([self._embed_chunk(images[i : i + self.embed_batch], dims, timings)
                               for i in range(0, len(images), self.embed_batch)])

    def _embed_chunk(self, images: list, dims: int, timings: Timings) -> np.ndarray:
        t0 = time.perf_counter()
        with torch.inference_mode():
            batch = self.model.preprocess(images, "sketch")  # (N, 3, H, W)
        t1 = time.perf_counter()
        out = self.encoder(batch)[:, :dims]  # (N, dims)
        t2 = time.perf_counter()
        timings.preprocess += t1 - t0
        timings.encode += t2 - t1
        return np.ascontiguousarray(out, dtype=np.float32)

    def decode(self, name: str, upload: bytes | BinaryIO) -> Image.Image:
        """One upload (bytes, or a file read here) -> RGB image, shrunk to `decode_side`."""
        data = upload if isinstance(upload, bytes) else upload.read()
        return decode_image(data, name, self.max_pixels, formats=SKETCH_FORMATS,
                            reduce_to=self.decode_side)

    def retrieve(self, uploads: list[tuple[str, bytes | BinaryIO]], dims: int, k: int
                 ) -> tuple[list[list[Hit]], Timings]:
        """Top-k photos for each uploaded sketch, scored on the first `dims` modes.

        Uploads are read and decoded one at a time, so a request holds one decoded image
        (shrunk) beside the preprocessed batch.
        """
        timings = Timings()
        with self.galleries.lease() as gallery:
            if not 1 <= dims <= gallery.dims:  # the one check of dims against the index
                raise DimsError(f"dims={dims} is outside [1, {gallery.dims}]")
            t0 = time.perf_counter()
            images = [self.decode(name, upload) for name, upload in uploads]
            timings.decode = time.perf_counter() - t0
            queries = self._embed(images, dims, timings)
            del images
            if gallery.query_width(dims) > dims:  # the hubness correction's coordinate
                queries = np.hstack([queries, np.ones((len(queries), 1), np.float32)])
            t0 = time.perf_counter()
            scores, rows = expanded_search(queries, k, gallery.search, gallery.vectors,
                                           gallery.pool, self.expansion,
                                           self.expand_rescore)  # (N, k') each
            timings.search = time.perf_counter() - t0
            hits = [_hits(gallery, srow, rrow) for srow, rrow in zip(scores, rows, strict=True)]
        return hits, timings

    def read_photo(self, photo_id: str) -> tuple[bytes, str]:
        """(bytes, media type) of a gallery photo by id (service.photo_files.read_photo)."""
        with self.galleries.lease() as gallery:
            return read_photo(gallery, photo_id, self.photos_root)


def _hits(gallery: GalleryIndex, scores: np.ndarray, rows: np.ndarray) -> list[Hit]:
    """Hits of one query from its (k',) scores and rows; only these rows of the photo table
    are decoded. FAISS marks missing results with row -1."""
    photos = gallery.photos
    return [Hit(p.id, p.cls, float(s), p.path)
            for s, p in ((s, photos[r]) for s, r in zip(scores, rows, strict=True) if r >= 0)]
