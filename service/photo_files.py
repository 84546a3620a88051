"""Serving gallery photo files: only ids in the photo table resolve, and only regular files
below the photo root are read, through real folders (no link is followed on the way)."""

from __future__ import annotations

import logging
import mimetypes
import os
import stat
from pathlib import Path

from index.store import GalleryIndex, IndexCorruptError

log = logging.getLogger(__name__)


class UnknownPhotoError(KeyError):
    pass


def read_photo(gallery: GalleryIndex, photo_id: str, photos_root: Path | None = None
               ) -> tuple[bytes, str]:
    """(bytes, media type) of a gallery photo by id; only files below the photo root
    (`photos_root`, else the one recorded in the index).

    The path is resolved and must stay below the (resolved) root, which refuses a link
    to elsewhere placed after the build; the file is then opened one real folder at a
    time without following links, so a link swapped in after that check fails too.
    UnknownPhotoError messages name the id only, never a server path. A table row whose
    path leaves the root is refused when it is read (`index.table`), before any of this.
    """
    row = gallery.row_of(photo_id)
    if row is None:
        raise UnknownPhotoError(f"no photo with id {photo_id!r} in the index")
    try:
        photo = gallery.photos[row]
    except IndexCorruptError as err:
        log.warning("refusing photo %r: %s", photo_id, err)
        raise UnknownPhotoError(f"photo {photo_id!r} is indexed but its table row is "
                                "damaged") from None
    root = Path(photos_root or gallery.sidecar.photos_root).resolve()
    path = gallery.photo_path(photo, photos_root)
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
