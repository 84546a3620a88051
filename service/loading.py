"""Loading what the service serves: the checkpoint (found from the settings or the index),
its sketch encoder, and the index's current version, checked to belong together."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from index.errors import IndexStoreError
from index.gpu import SerializedIndex, gpu_available, to_gpu
from index.store import GalleryIndex, current_version, load_index, read_sidecar
from index.threads import set_threads
from service.encoders import pick_encoder
from service.retrieval import RetrievalEngine, check_width
from service.settings import Settings
from training.cdk.config import expansion, from_dict
from training.cdk.model.embedder import Embedder

log = logging.getLogger(__name__)


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


def version_name(folder: Path) -> str | None:
    """The name of the index version CURRENT points to (None: a folder without versions)."""
    version = current_version(folder)
    return None if version == Path(folder) else version.name


def open_current(folder: Path, embedder) -> tuple[GalleryIndex, str | None]:
    """The current version of the index at `folder` and its name, checked against the
    served checkpoint (its hash and its embeddings' width); memory-mapped, read only.

    The pointer is read before and after loading: equal, the version loaded is the one
    named (pointers only move to new names), else a writer switched meanwhile: again.
    """
    for _ in range(3):
        before = version_name(folder)
        gallery = load_index(folder, checkpoint_sha256=embedder.checkpoint_sha256, mmap=True)
        if version_name(folder) == before:
            break
    else:
        raise IndexStoreError(f"the index at {str(folder)!r} changed during each of 3 loads")
    check_width(embedder, gallery)
    if gpu_available() and gallery.kind.gpu:
        # HNSW has no GPU version in FAISS; GPU indexes are not thread-safe, and requests
        # search from several threads: one search at a time.
        gallery.index = SerializedIndex(to_gpu(gallery.index))
        log.info("index moved to GPU")
    return gallery, before


def load_engine(settings: Settings) -> RetrievalEngine:
    """Load the model and the index once (at startup), checking they belong together."""
    set_threads(settings.threads)
    checkpoint = find_checkpoint(settings)
    embedder = Embedder.from_checkpoint(checkpoint, device=settings.device,
                                        sketch_flip_average=settings.mirror_queries)
    gallery, version = open_current(settings.index, embedder)
    encoder = pick_encoder(settings, embedder)
    log.info("loaded %s (width %d, %s, sketches by %s) and index %s version %s (%d photos, "
             "%d dims, %s)", checkpoint, embedder.width, embedder.backbone, encoder.name,
             settings.index, version, len(gallery), gallery.dims, gallery.sidecar.kind)
    expand = expansion(from_dict(embedder.config))
    if settings.expand_n is not None:
        expand = dataclasses.replace(expand, n=settings.expand_n)
    return RetrievalEngine(embedder, gallery, settings.max_pixels, settings.photos_dir,
                           checkpoint, decode_side=2 * embedder.size_of("sketch"),
                           embed_batch=settings.embed_batch, encoder=encoder, version=version,
                           expansion=expand, expand_rescore=settings.expand_rescore)
