"""Photo galleries on disk: find the photos and name them (`index.embed` embeds them).

The folder layouts and the stray-file rule are `training.folders.scan_gallery`'s (a plain
`DIR/<class>/<photo>`, a paired folder or the official Sketchy Extended layout); photos are
decoded by `training.images.load_image`, as in training. A photo's id is its file stem; ids
must be unique in a gallery because `/photos/{id}` serves them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from training.folders import DataError
from training.folders import scan_gallery as scan_folder

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
