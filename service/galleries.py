"""The gallery being served, swappable while requests use it.

A request leases the current gallery for as long as it needs it (`with holder.lease() as
gallery:`), so one request sees one version from its dims check to its photo rows. `swap`
makes a new version current for the requests that start after it; the old one is closed
(its memory-mapped vectors and photo table released) when its last lease ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from index.store import GalleryIndex

log = logging.getLogger(__name__)


@dataclass
class _Served:
    gallery: GalleryIndex | None
    version: str | None
    leases: int = 0
    retired: bool = False


class GalleryHolder:
    """The current gallery and its version name (None: an index folder without versions)."""

    def __init__(self, gallery: GalleryIndex, version: str | None = None):
        self._lock = threading.Lock()
        self._current = _Served(gallery, version)
        self.open_versions = 1  # the current one, plus retired ones still leased

    def current(self) -> tuple[GalleryIndex, str | None]:
        """The current gallery and its version, unleased: for what a swap cannot break (a
        reference keeps the object readable; /info)."""
        with self._lock:
            return self._current.gallery, self._current.version

    @contextmanager
    def lease(self) -> Iterator[GalleryIndex]:
        with self._lock:
            served = self._current
            served.leases += 1
        try:
            yield served.gallery
        finally:
            with self._lock:
                served.leases -= 1
                last = served.retired and served.leases == 0
            if last:
                self._close(served)

    def swap(self, gallery: GalleryIndex, version: str | None) -> None:
        """Serve `gallery` from now on; close the old one once no request holds it."""
        with self._lock:
            old, self._current = self._current, _Served(gallery, version)
            old.retired = True
            self.open_versions += 1
            idle = old.leases == 0
        log.info("serving index version %s (%d photos); version %s retired", version,
                 len(gallery), old.version)
        if idle:
            self._close(old)

    def _close(self, served: _Served) -> None:
        served.gallery = None  # the last reference: FAISS and the table unmap their files
        with self._lock:
            self.open_versions -= 1
        log.info("closed index version %s", served.version)
