"""Photo galleries on disk: find the photos, name them, embed them.

The folder layouts and the stray-file rule are `training.folders.scan_gallery`'s (a plain
`DIR/<class>/<photo>`, a paired folder or the official Sketchy Extended layout); photos are
decoded by `training.images.load_image`, as in training. A photo's id is its file stem; ids
must be unique in a gallery because `/photos/{id}` serves them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from training.cdk.embedder import Embedder
from training.folders import DataError
from training.folders import scan_gallery as scan_folder
from training.images import load_image

log = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True)
class Photo:
    """One gallery photo: its id, its class, and its path relative to the gallery root."""

    id: str
    cls: str
    path: str


def scan_gallery(folder: str | Path) -> tuple[Path, list[Photo]]:
    """List the photos of a gallery folder, sorted by (class, file).

    Returns the resolved root (what `Photo.path` is relative to) and the photos. DataError
    when the folder has no class subfolders, no photos or a stray file, when two photos
    share an id or an id breaks `ID_PATTERN`, or when a photo is a link to a file outside
    the root (the service serves files below the root only).
    """
    root, by_class = scan_folder(folder)
    photos: list[Photo] = []
    seen: dict[str, str] = {}
    for cls, files in by_class.items():
        for f in files:
            pid = f.stem
            rel = f.relative_to(root).as_posix()
            if not f.resolve().is_relative_to(root):
                raise DataError(
                    f"photo {str(f)!r} is a link to {str(f.resolve())!r}, outside the photo "
                    f"folder {str(root)!r}; copy the file into the folder instead"
                )
            if not ID_PATTERN.match(pid):
                raise DataError(
                    f"photo {str(f)!r} has id {pid!r}; ids must match {ID_PATTERN.pattern}"
                )
            if pid in seen:
                raise DataError(f"photo id {pid!r} is used by both {seen[pid]!r} and {rel!r}")
            seen[pid] = rel
            photos.append(Photo(id=pid, cls=cls, path=rel))
    return root, photos


def embed_photos(
    embedder: Embedder,
    root: Path,
    photos: list[Photo],
    dims: int,
    batch_size: int = 32,
    progress: bool = True,
) -> np.ndarray:
    """Embed photos with the checkpoint's photo side; keep the top `dims` modes.

    Returns a C-contiguous float32 array (N, dims).
    """
    if not 1 <= dims <= embedder.L:
        raise ValueError(f"dims={dims} is outside [1, L={embedder.L}]")
    out = np.empty((len(photos), dims), dtype=np.float32)
    bar = tqdm(total=len(photos), desc="embedding photos", unit="img", disable=not progress)
    for start in range(0, len(photos), batch_size):
        chunk = photos[start : start + batch_size]
        images = [load_image(root / p.path) for p in chunk]
        emb = np.asarray(embedder.embed(images, "photo", batch_size=batch_size), dtype=np.float32)
        if emb.shape != (len(chunk), embedder.L):
            raise ValueError(
                f"embedder returned shape {emb.shape}, expected {(len(chunk), embedder.L)}"
            )
        out[start : start + len(chunk)] = emb[:, :dims]
        bar.update(len(chunk))
    bar.close()
    log.info("embedded %d photos from %s into %d dims", len(photos), root, dims)
    return out
