"""Photo galleries on disk: find the photos of a folder and name them (`index.embed` embeds
them).

A gallery is any folder a person keeps photos in:
* a flat folder of photos (no classes);
* nested folders: the first level below the folder is a photo's class, at any depth below
  it (photos directly in the folder have none);
* the photo side of a paired training folder (`photo/<class>/...`) or of the official
  Sketchy Extended download, read as it is (`training.folders.gallery_roots`).
Image files are those of `training.folders.IMAGE_SUFFIXES`; hidden entries are ignored;
anything else (other files, links that lead out of the folder, linked folders) is skipped
and counted (`Scan.skipped`), never an error. A photo that fails to decode is found when it
is embedded, and listed then.

A photo's id is its file stem where that is a safe id (`ID_PATTERN`) used by no other photo
of the gallery: `n02691156_10151.jpg` keeps `n02691156_10151`. Otherwise the id is the stem
in ASCII letters, digits and `._-`, then `-` and 8 hex digits of a hash of its path in the
gallery: `beach/jellyfish 1.jpg` is `jellyfish-1-` + 8 hex. The same file in the same place
always gets the same id; the path (`Photo.path`) is kept for display.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from training.folders import IMAGE_SUFFIXES, DataError, gallery_roots

__all__ = ["ID_PATTERN", "Photo", "Scan", "path_hash", "photo_id", "scan_gallery", "unique_ids"]

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
SLUG_MAX = 80  # characters of a derived id before its hash


@dataclass(frozen=True)
class Photo:
    """One gallery photo: its id, its class ("" for none), and its path relative to the
    gallery root."""

    id: str
    cls: str
    path: str


@dataclass(frozen=True)
class Scan:
    """A gallery folder as found: the resolved `root` photo paths are relative to, the
    photos sorted by (class, path), and what was skipped, by reason -> paths."""

    root: Path
    photos: list[Photo]
    skipped: dict[str, list[str]] = field(default_factory=dict)

    @property
    def has_classes(self) -> bool:
        return any(p.cls for p in self.photos)

    def summary(self) -> str:
        """One line: the photos, their classes, and what was skipped."""
        classes = len({p.cls for p in self.photos if p.cls})
        line = (f"{len(self.photos)} photos in {classes} classes" if classes
                else f"{len(self.photos)} photos (no class folders)")
        for reason, paths in sorted(self.skipped.items()):
            shown = ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
            line += f"; skipped {len(paths)} {reason} ({shown})"
        return line


def path_hash(rel: str) -> str:
    """8 hex digits of a hash of a photo's path in its gallery (derived ids end in it)."""
    return hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def photo_id(rel: str) -> str:
    """The id a photo at gallery path `rel` gets when no other photo claims its stem."""
    stem = PurePosixPath(rel).stem
    if ID_PATTERN.match(stem):
        return stem
    ascii_stem = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", ascii_stem).strip("-._")[:SLUG_MAX] or "photo"
    return f"{slug}-{path_hash(rel)}"


def unique_ids(paths: list[str], taken: set[str] = frozenset()) -> list[str]:
    """Ids of the photos at `paths`: `photo_id`, and where two photos (or one of `taken`)
    would share one, each of them gets its path's hash appended."""
    ids = [photo_id(p) for p in paths]
    counts = Counter(ids)
    out = [f"{i}-{path_hash(p)}" if counts[i] > 1 or i in taken else i
           for i, p in zip(ids, paths, strict=True)]
    clash = [i for i, n in Counter(out).items() if n > 1 or i in taken]
    if clash:  # a hash collision among derived ids: name it rather than serve the wrong file
        raise DataError(f"photo ids {clash[:3]} are not unique even with their path hashes; "
                        "rename one of those files")
    return out


def _walk(root: Path, skipped: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(class, path relative to `root`) of the image files below `root`."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for d in list(dirs):
            if (here / d).is_symlink():
                dirs.remove(d)
                skipped.setdefault("linked folders", []).append((here / d).relative_to(
                    root).as_posix())
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = here / name
            rel = path.relative_to(root).as_posix()
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                skipped.setdefault("files that are not images", []).append(rel)
            elif path.is_symlink() and not path.resolve().is_relative_to(root):
                skipped.setdefault("links to files outside the folder", []).append(rel)
            elif not path.is_file():
                skipped.setdefault("entries that are not regular files", []).append(rel)
            else:
                parts = PurePosixPath(rel).parts
                found.append((parts[0] if len(parts) > 1 else "", rel))
    return found


def scan_gallery(folder: str | Path) -> Scan:
    """The photos of a gallery folder (layouts in the module docstring), sorted by
    (class, path). DataError when the folder does not exist or holds no image."""
    roots = [r.resolve() for r in gallery_roots(folder)]
    root = Path(os.path.commonpath(roots))
    skipped: dict[str, list[str]] = {}
    found: list[tuple[str, str]] = []
    for r in roots:
        prefix = r.relative_to(root).as_posix()
        for cls, rel in _walk(r, skipped):
            found.append((cls, rel if prefix == "." else f"{prefix}/{rel}"))
    if not found:
        raise DataError(f"photo folder {str(folder)!r} holds no images "
                        f"({', '.join(sorted(IMAGE_SUFFIXES))}; looked in "
                        f"{[str(r) for r in roots]})")
    found.sort()
    ids = unique_ids([rel for _, rel in found])
    photos = [Photo(id=i, cls=cls, path=rel) for i, (cls, rel) in zip(ids, found, strict=True)]
    return Scan(root, photos, skipped)
