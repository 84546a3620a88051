"""The folder scanner every layer uses: which image files a data folder holds, by class.

Layouts:
* paired folder: ROOT/sketch/<class>/<file>, ROOT/photo/<class>/<file> (sketchy-mini);
* official Sketchy Extended: ROOT/sketch/tx_000000000000/<class>/..., ROOT/photo/
  tx_000000000000/<class>/..., plus the extended photos in ROOT/extended_photo/<class>/ or
  ROOT/EXTEND_image_sketchy/<class>/ when present;
* photo gallery (the index): the photo side of either (`gallery_roots`), or any folder
  (`index.gallery` scans it, skipping what is not an image).
In training data a class folder holds image files only: anything else in it (another
folder, a file with another suffix) is a DataError naming it, since a silently skipped file
is a silently wrong dataset. Hidden entries (.DS_Store, editor swap files) are ignored
everywhere.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = [
    "IMAGE_SUFFIXES", "OFFICIAL_SUBDIR", "EXTENDED_PHOTO_DIRS", "DataError", "list_images",
    "class_folders", "images_by_class", "paired_roots", "gallery_roots", "scan_paired",
]

log = logging.getLogger(__name__)

# The suffixes of training.images.FORMATS (JPEG, PNG, WebP, BMP), compared lower-cased.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp"})
OFFICIAL_SUBDIR = "tx_000000000000"
EXTENDED_PHOTO_DIRS = ("extended_photo", "EXTEND_image_sketchy")

ByClass = dict[str, list[Path]]


class DataError(ValueError):
    """A data folder that cannot be used; the message names the offending file or folder."""


def _visible(p: Path) -> bool:
    return not p.name.startswith(".")


def list_images(class_dir: Path) -> list[Path]:
    """The image files of one class folder, sorted by name; DataError on any other entry."""
    files = []
    for p in sorted(filter(_visible, class_dir.iterdir())):
        if p.is_dir() or p.suffix.lower() not in IMAGE_SUFFIXES:
            raise DataError(f"unexpected entry {str(p)!r}: expected image files "
                            f"({sorted(IMAGE_SUFFIXES)}) in class folders")
        files.append(p)
    return files


def class_folders(root: Path) -> dict[str, Path]:
    """{class name: folder} for the visible subfolders of ``root``, sorted by name."""
    return {d.name: d for d in sorted(filter(_visible, root.iterdir())) if d.is_dir()}


def images_by_class(roots: list[Path]) -> ByClass:
    """{class: files} over several ``<class>/<file>`` roots (files of a class in root order,
    classes sorted); a class may be missing from some roots."""
    out: ByClass = {}
    for root in roots:
        for cls, folder in class_folders(root).items():
            out.setdefault(cls, []).extend(list_images(folder))
    return dict(sorted(out.items()))


def _is_official(root: Path) -> bool:
    return any((root / side / OFFICIAL_SUBDIR).is_dir() for side in ("sketch", "photo"))


def _photo_roots(root: Path) -> list[Path]:
    if not _is_official(root):
        return [root / "photo"]
    roots = [d for d in [root / "photo" / OFFICIAL_SUBDIR] if d.is_dir()]
    return roots + [root / d for d in EXTENDED_PHOTO_DIRS if (root / d).is_dir()]


def paired_roots(root: str | Path) -> tuple[list[Path], list[Path]]:
    """(sketch roots, photo roots) of a paired or Sketchy Extended folder, each root holding
    ``<class>/<file>``; DataError when ROOT, ROOT/sketch or ROOT/photo is missing."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data folder {str(root)!r} does not exist")
    for side in ("sketch", "photo"):
        if not (root / side).is_dir():
            raise DataError(f"data folder {str(root)!r} has no {side}/ subfolder")
    official = _is_official(root)
    sketch_roots = [root / "sketch" / OFFICIAL_SUBDIR] if official else [root / "sketch"]
    photo_roots = _photo_roots(root)
    if official:
        log.info("Sketchy Extended layout: sketches %s, photos %s", sketch_roots, photo_roots)
    return sketch_roots, photo_roots


def gallery_roots(folder: str | Path) -> list[Path]:
    """The photo roots of a gallery: the photo side of a paired or Sketchy Extended folder,
    the tx_000000000000/ folder inside an official photo/ folder, else ``folder`` itself."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"photo folder {str(folder)!r} does not exist")
    if (folder / "photo").is_dir():
        return _photo_roots(folder)
    if (folder / OFFICIAL_SUBDIR).is_dir():
        return [folder / OFFICIAL_SUBDIR]
    return [folder]


def _where(roots: list[Path], cls: str) -> list[str]:
    return [str(r / cls) for r in roots if (r / cls).is_dir()]


def scan_paired(root: str | Path) -> tuple[ByClass, ByClass]:
    """({class: sketch files}, {class: photo files}) of a paired or Sketchy Extended folder,
    same classes on both sides. DataError names a class present on one side only, an empty
    class, or a stray entry."""
    sketch_roots, photo_roots = paired_roots(root)
    sketches, photos = images_by_class(sketch_roots), images_by_class(photo_roots)
    only_s = sorted(set(sketches) - set(photos))
    only_p = sorted(set(photos) - set(sketches))
    if only_s or only_p:
        where = [f"{_where(sketch_roots, c)[0]} has no photo class" for c in only_s]
        where += [f"{_where(photo_roots, c)[0]} has no sketch class" for c in only_p]
        raise DataError("classes present in one modality only: " + "; ".join(where[:5]))
    if not sketches:
        raise DataError(f"no class folders under {[str(r) for r in sketch_roots]}")
    for cls in sketches:
        if not sketches[cls]:
            raise DataError(f"empty class: no sketches in {_where(sketch_roots, cls)}")
        if not photos[cls]:
            raise DataError(f"empty class: no photos in {_where(photo_roots, cls)}")
    return sketches, photos
