"""Loading what the service serves: the model bundle (from the settings or the index's
sidecar), its sketch encoder, and the index's current version, checked to belong together.
Everything is read; nothing is made or written."""

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
from training.cdk.model.bundle import Bundle

log = logging.getLogger(__name__)


def find_model(settings: Settings) -> Path:
    """The model bundle to serve: the setting, else the one the index's sidecar names."""
    if settings.model is not None:
        return settings.model
    recorded = read_sidecar(settings.index).model
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    raise FileNotFoundError(
        f"the model bundle the index {str(settings.index)!r} was built with is not at "
        f"{recorded!r}; set SKETCHSVD_MODEL or --model to its folder")


def version_name(folder: Path) -> str | None:
    """The name of the index version CURRENT points to (None: a folder without versions)."""
    version = current_version(folder)
    return None if version == Path(folder) else version.name


def open_current(folder: Path, model, photos_root: str | None = None
                 ) -> tuple[GalleryIndex, str | None]:
    """The current version of the index at `folder` and its name, checked against the
    served model (its sha256 and its embeddings' width) and, when given, the photo folder
    fixed at start (`photos_root`: a version that names another is refused); memory-mapped,
    read only.

    The pointer is read before and after loading: equal, the version loaded is the one
    named (pointers only move to new names), else a writer switched meanwhile: again.
    """
    for _ in range(3):
        before = version_name(folder)
        gallery = load_index(folder, model_sha256=model.sha256, mmap=True)
        if version_name(folder) == before:
            break
    else:
        raise IndexStoreError(f"the index at {str(folder)!r} changed during each of 3 loads")
    check_width(model, gallery)
    if photos_root is not None and gallery.sidecar.photos_root != photos_root:
        raise IndexStoreError(
            f"index version {before} names the photo folder {gallery.sidecar.photos_root!r}, "
            f"not the one this service serves ({photos_root!r}); restart the service to serve "
            "another photo folder")
    if gallery_on_gpu(gallery):
        # HNSW has no GPU version in FAISS; GPU indexes are not thread-safe, and requests
        # search from several threads: one search at a time.
        gallery.index = SerializedIndex(to_gpu(gallery.index))
        log.info("index moved to GPU")
    return gallery, before


def gallery_on_gpu(gallery: GalleryIndex) -> bool:
    return gpu_available() and gallery.kind.gpu


def load_engine(settings: Settings) -> RetrievalEngine:
    """Load the model and the index once (at startup), checking they belong together."""
    set_threads(settings.threads)
    model = Bundle.open(find_model(settings))
    gallery, version = open_current(settings.index, model)
    encoder = pick_encoder(settings, model)
    log.info("loaded model %s, sketches by %s %s; index %s version %s (%d photos, %d dims, "
             "%s)", model.describe(), encoder.name, encoder.precision, settings.index, version,
             len(gallery), gallery.dims, gallery.sidecar.kind)
    expand = model.inference.query_expansion()
    if settings.expand_n is not None:
        expand = dataclasses.replace(expand, n=settings.expand_n)
    return RetrievalEngine(model, gallery, settings.max_pixels, settings.photos_dir,
                           decode_side=2 * model.size_of("sketch"),
                           embed_batch=settings.embed_batch, encoder=encoder, version=version,
                           expansion=expand, expand_rescore=settings.expand_rescore,
                           sketch_flip_average=encoder_mirrors(model, settings))


def encoder_mirrors(model, settings: Settings) -> bool:
    """Whether served sketches are averaged with their mirror image."""
    trained = bool(model.inference.flip_average["sketch"])
    return trained and settings.sketch_flip_average is not False
