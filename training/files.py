"""Files: atomic writes (a temp file beside the target, fsync, then rename over it, so a
reader never sees a half-written checkpoint or metrics file; files get the usual mode,
0666 & ~umask, so 0644 under the common umask 022)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch


def _atomic(path: str | Path, mode: str, write: Callable[[IO], None]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # Mode 0666 & ~umask like any new file (mkstemp's 0600 hid checkpoints from a service
    # running as another user); O_EXCL: never write through an existing name or link.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)  # the rename itself survives a crash
    return path


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically."""
    return _atomic(path, "wb", lambda fh: torch.save(obj, fh))


def atomic_write_bytes(data: bytes, path: str | Path) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return _atomic(path, "wb", lambda fh: fh.write(data))


def atomic_write_text(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return _atomic(path, "w", lambda fh: fh.write(text))


def atomic_savefig(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically (format from the suffix, PNG by default), then
    close it so long runs do not accumulate open figures."""
    import matplotlib.pyplot as plt  # here, so checkpoint writers never load matplotlib

    fmt = Path(path).suffix.lstrip(".") or "png"
    try:
        return _atomic(path, "wb", lambda fh: fig.savefig(fh, format=fmt, dpi=dpi))
    finally:
        plt.close(fig)
