"""Photo galleries on disk: find the photos, name them, read them.

A gallery folder is either `DIR/<class>/<photo>` or a paired folder `DIR/photo/<class>/<photo>`
(the shape of sketchy-mini and of the Sketchy download). A photo's id is its file stem; ids
must be unique in a gallery because `/photos/{id}` serves them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from training.cdk.embedder import Embedder

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp"})
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True)
class Photo:
    """One gallery photo: its id, its class, and its path relative to the gallery root."""

    id: str
    cls: str
    path: str


def photo_root(folder: str | Path) -> Path:
    """The folder holding `<class>/<photo>`: DIR itself, or DIR/photo for a paired folder."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"photo folder {str(root)!r} does not exist")
    if (root / "photo").is_dir():
        return root / "photo"
    return root


def scan_gallery(folder: str | Path) -> tuple[Path, list[Photo]]:
    """List the photos of a gallery folder, sorted by (class, file name).

    Returns the resolved root (what `Photo.path` is relative to) and the photos. Raises when
    the folder has no class subfolders or no photos, or when two photos share an id.
    """
    root = photo_root(folder).resolve()
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"photo folder {str(root)!r} has no class subfolders")
    photos: list[Photo] = []
    seen: dict[str, str] = {}
    for class_dir in classes:
        files = sorted(
            f for f in class_dir.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
        )
        for f in files:
            pid = f.stem
            rel = f.relative_to(root).as_posix()
            if not ID_PATTERN.match(pid):
                raise ValueError(
                    f"photo {str(f)!r} has id {pid!r}; ids must match {ID_PATTERN.pattern}"
                )
            if pid in seen:
                raise ValueError(f"photo id {pid!r} is used by both {seen[pid]!r} and {rel!r}")
            seen[pid] = rel
            photos.append(Photo(id=pid, cls=class_dir.name, path=rel))
    if not photos:
        raise ValueError(f"photo folder {str(root)!r} has class folders but no images")
    return root, photos


def read_rgb(path: Path) -> Image.Image:
    """Decode one gallery photo as RGB, naming the file when it cannot be read."""
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"cannot read photo {str(path)!r}: {err}") from err


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
        images = [read_rgb(root / p.path) for p in chunk]
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
