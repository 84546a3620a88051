"""Retrieval: sketch images -> sketch embeddings (d-prefix) -> top-k gallery photos.

Plain domain code, no HTTP: the routes call it and turn its errors into status codes.
"""

from __future__ import annotations

import logging
import mimetypes
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import torch
from PIL import Image

from index.gpu import SerializedIndex, gpu_available, to_gpu
from index.store import GalleryIndex, IndexCorruptError, load_index, read_sidecar
from index.threads import set_threads
from service.settings import Settings
from training.cdk.model.embedder import Embedder
from training.cdk.model.export import EncoderMismatchError, load_or_export
from training.images import decode_image

log = logging.getLogger(__name__)

SKETCH_FORMATS = ("PNG", "JPEG", "WEBP")  # what the web page and API clients may upload


class UnknownPhotoError(KeyError):
    pass


class DimsError(ValueError):
    pass


@dataclass(frozen=True)
class Hit:
    id: str
    cls: str
    score: float


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


class Encoder(Protocol):
    """(N, 3, S, S) normalised sketch images -> (N, L) float32 embeddings; callable from
    several threads at once."""

    name: str

    def __call__(self, batch: torch.Tensor) -> np.ndarray: ...


class TorchEncoder:
    """The sketch side of `embedder` in PyTorch, on its device."""

    name = "torch"

    def __init__(self, embedder: Embedder):
        self.embedder = embedder

    def __call__(self, batch: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return self.embedder.encode(batch, "sketch").float().cpu().numpy()


class RetrievalEngine:
    def __init__(self, embedder: Embedder, gallery: GalleryIndex, max_pixels: int,
                 photos_root: Path | None = None, checkpoint: Path | None = None,
                 inference_slots: int = 2, decode_side: int | None = None,
                 embed_batch: int = 16, encoder: Encoder | None = None):
        if embedder.width != gallery.sidecar.width:
            raise IndexCorruptError(
                f"the checkpoint's embeddings are {embedder.width} wide but the index was "
                f"built from embeddings {gallery.sidecar.width} wide"
            )
        self.embedder = embedder
        self.gallery = gallery
        self.max_pixels = max_pixels
        self.photos_root = photos_root
        self.checkpoint = checkpoint
        # Uploads are shrunk while decoding to keep both sides >= decode_side (None: not
        # shrunk); the model resizes them to its input size anyway.
        self.decode_side = decode_side
        self.embed_batch = embed_batch
        # Sketches are embedded by `encoder` (ONNX Runtime on the CPU, see pick_encoder);
        # the photo side is never run here: photos are embedded by index.build.
        self.encoder = encoder or TorchEncoder(embedder)
        self._slots = threading.BoundedSemaphore(inference_slots)

    @property
    def dims(self) -> int:
        """Largest servable d: the stored prefix length."""
        return self.gallery.dims

    def embed_sketches(self, images: list, dims: int, timings: Timings) -> np.ndarray:
        """Images -> (N, dims) sketch embeddings, timing each stage."""
        with self._slots:
            return self._embed(images, dims, timings)

    def _embed(self, images: list, dims: int, timings: Timings) -> np.ndarray:
        # Forwards of at most embed_batch images: backbone activations grow with the batch
        # (about 185 MB for 16 sketches at 224 px on CPU), and a slot's memory must not.
        return np.concatenate([self._embed_chunk(images[i : i + self.embed_batch], dims, timings)
                               for i in range(0, len(images), self.embed_batch)])

    def _embed_chunk(self, images: list, dims: int, timings: Timings) -> np.ndarray:
        t0 = time.perf_counter()
        with torch.inference_mode():
            batch = self.embedder.preprocess(images, "sketch")  # (N, 3, H, W)
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

        Uploads are read and decoded one at a time inside an inference slot, so at most
        `inference_slots` requests hold decoded images (each shrunk) at once.
        """
        if not 1 <= dims <= self.dims:  # the one check of dims against the index
            raise DimsError(f"dims={dims} is outside [1, {self.dims}]")
        timings = Timings()
        with self._slots:
            t0 = time.perf_counter()
            images = [self.decode(name, upload) for name, upload in uploads]
            timings.decode = time.perf_counter() - t0
            queries = self._embed(images, dims, timings)
            del images
        t0 = time.perf_counter()
        scores, rows = self.gallery.search(queries, k)  # (N, k') each
        timings.search = time.perf_counter() - t0
        hits = [self._hits(srow, rrow) for srow, rrow in zip(scores, rows, strict=True)]
        return hits, timings

    def _hits(self, scores: np.ndarray, rows: np.ndarray) -> list[Hit]:
        """Hits of one query from its (k',) scores and rows; only these rows of the photo
        table are decoded. FAISS marks missing results with row -1."""
        photos = self.gallery.photos
        return [Hit(p.id, p.cls, float(s))
                for s, p in ((s, photos[r]) for s, r in zip(scores, rows, strict=True) if r >= 0)]

    def read_photo(self, photo_id: str) -> tuple[bytes, str]:
        """(bytes, media type) of a gallery photo by id; only files below the photo root.

        The path is resolved and must stay below the (resolved) root, which refuses a link
        to elsewhere placed after the build; the file is then opened one real folder at a
        time without following links, so a link swapped in after that check fails too.
        UnknownPhotoError messages name the id only, never a server path. A table row whose
        path leaves the root is refused when it is read (`index.table`), before any of this.
        """
        row = self.gallery.row_of(photo_id)
        if row is None:
            raise UnknownPhotoError(f"no photo with id {photo_id!r} in the index")
        try:
            photo = self.gallery.photos[row]
        except IndexCorruptError as err:
            log.warning("refusing photo %r: %s", photo_id, err)
            raise UnknownPhotoError(f"photo {photo_id!r} is indexed but its table row is "
                                    "damaged") from None
        root = Path(self.photos_root or self.gallery.sidecar.photos_root).resolve()
        path = self.gallery.photo_path(photo, self.photos_root)
        real = path.resolve()
        if not real.is_relative_to(root):
            log.warning("refusing photo %r: %s resolves to %s, outside the photo root %s",
                        photo_id, path, real, root)
            raise UnknownPhotoError(f"photo {photo_id!r} is indexed but its file is not "
                                    "below the photo folder")
        try:
            data = read_below(root, real.relative_to(root))
        except OSError as err:
            log.warning("cannot serve photo %r from %s: %s", photo_id, path, err)
            raise UnknownPhotoError(f"photo {photo_id!r} is indexed but its file is missing "
                                    "or unreadable") from None
        return data, mimetypes.guess_type(photo.path)[0] or "application/octet-stream"


def read_below(root: Path, rel: Path) -> bytes:
    """Bytes of the regular file `root/rel`, reached through real folders only.

    Every step is opened relative to the previous folder with O_NOFOLLOW: a link anywhere
    below `root` is an OSError (ELOOP or ENOTDIR), as is anything but a regular file.
    """
    if not rel.parts:
        raise OSError(f"{rel} is the root itself")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in rel.parts[:-1]:
            step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = step
        # O_NONBLOCK: a FIFO planted in the gallery must not hang the worker thread.
        file_fd = os.open(rel.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK,
                          dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(file_fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{rel} is not a regular file")
        return f.read()


def find_checkpoint(settings: Settings) -> Path:
    """The checkpoint to serve: the setting, else the sidecar's path, else next to the index."""
    if settings.checkpoint is not None:
        return settings.checkpoint
    tried = [Path(read_sidecar(settings.index).checkpoint), settings.index / "checkpoint.pt",
             settings.index.parent / "checkpoint.pt"]
    for path in tried:
        if path.is_file():
            return path
    raise FileNotFoundError(
        "no checkpoint found for index " + repr(str(settings.index)) + "; tried "
        + ", ".join(repr(str(p)) for p in tried) + "; set SKETCHSVD_CHECKPOINT or --checkpoint"
    )


def pick_encoder(settings: Settings, embedder: Embedder) -> Encoder:
    """The sketch encoder the settings ask for. auto: ONNX Runtime when the model runs on
    the CPU (exported once per checkpoint and cached under the index folder), else
    PyTorch; PyTorch also when the export or ONNX Runtime is unavailable (with a warning).
    An exported file of another checkpoint is always an error (EncoderMismatchError)."""
    on_cpu = embedder.device.type == "cpu"
    if settings.encoder == "torch" or (settings.encoder == "auto" and not on_cpu):
        return TorchEncoder(embedder)
    if not on_cpu:
        raise ValueError(f"encoder=onnx runs on the CPU, but the model is on {embedder.device};"
                         " set --device cpu, or encoder auto or torch")
    try:
        return load_or_export(embedder, settings.index, threads=settings.threads)
    except EncoderMismatchError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the optional fast path
        if settings.encoder == "onnx":
            raise
        log.warning("serving sketches with PyTorch: the ONNX encoder is unavailable (%s: %s)",
                    type(err).__name__, err)
        return TorchEncoder(embedder)


def load_engine(settings: Settings) -> RetrievalEngine:
    """Load the model and the index once (at startup), checking they belong together."""
    set_threads(settings.threads)
    checkpoint = find_checkpoint(settings)
    embedder = Embedder.from_checkpoint(checkpoint, device=settings.device,
                                        flip_average=settings.mirror_queries)
    gallery = load_index(settings.index, checkpoint_sha256=embedder.checkpoint_sha256, mmap=True)
    if gpu_available() and gallery.kind.gpu:
        # HNSW has no GPU version in FAISS; GPU indexes are not thread-safe, and requests
        # search from several threads: one search at a time.
        gallery.index = SerializedIndex(to_gpu(gallery.index))
        log.info("index moved to GPU")
    encoder = pick_encoder(settings, embedder)
    log.info("loaded %s (L=%d, %s, sketches by %s) and index %s (%d photos, %d dims, %s)",
             checkpoint, embedder.width, embedder.backbone, encoder.name, settings.index,
             len(gallery), gallery.dims, gallery.sidecar.kind)
    return RetrievalEngine(embedder, gallery, settings.max_pixels, settings.photos_dir,
                           checkpoint, settings.inference_slots,
                           decode_side=2 * embedder.image_size, embed_batch=settings.embed_batch,
                           encoder=encoder)
