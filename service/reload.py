"""Hot index reload: serve a new index version without a restart.

The index writer (`index.build`, `index.add`) stages each version in its own folder and then
replaces `INDEX/CURRENT` atomically (index.store). The service reads that pointer every
`reload_interval` seconds (and on `POST /admin/reload`); when it names another version, the
new one is opened beside the one being served, checked (complete, built from the served
model bundle, embeddings as wide as the model's) and swapped in for the requests that
start after it; the old one is closed when its last request ends (service.galleries). A
version that names another photo folder than the one served since start is refused. A
version that fails its checks is refused with a log line naming the reason, the old one
keeps serving, and the same version is not tried again until the pointer moves or a reload
is forced.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anyio import to_thread

from index.errors import IndexStoreError
from service.loading import open_current, version_name
from service.retrieval import RetrievalEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What a check found: `served` is the version served after it."""

    served: str | None
    changed: bool = False
    refused: str | None = None  # the reason a new version was refused


class Reloader:
    def __init__(self, engine: RetrievalEngine, folder: Path,
                 on_swap: Callable[[], None] = lambda: None):
        self.engine = engine
        self.folder = Path(folder)
        self.on_swap = on_swap
        self.reloads = 0
        self.refusals = 0
        self._refused: tuple[str | None, str] | None = None  # (version, reason) last refused
        self._lock = threading.Lock()  # one check at a time (the poller, /admin/reload)

    def check(self, force: bool = False) -> Outcome:
        """Serve the version CURRENT names if it is new and sound (blocking: run it in a
        worker thread). `force`: try a version refused before again."""
        with self._lock:
            served = self.engine.galleries.current()[1]
            try:
                name = version_name(self.folder)
            except IndexStoreError as err:
                return self._refuse(None, str(err), served, force)
            if name == served:
                return Outcome(served)
            if not force and self._refused is not None and self._refused[0] == name:
                return Outcome(served, refused=self._refused[1])
            try:
                gallery, loaded = open_current(self.folder, self.engine.model,
                                               self.engine.recorded_root)
            except (IndexStoreError, ValueError, OSError, RuntimeError) as err:
                return self._refuse(name, f"{type(err).__name__}: {err}", served, force)
            self.engine.galleries.swap(gallery, loaded)
            self._refused = None
            self.reloads += 1
            self.on_swap()
            return Outcome(loaded, changed=True)

    def _refuse(self, name: str | None, reason: str, served: str | None, force: bool
                ) -> Outcome:
        if force or self._refused != (name, reason):  # logged once per version and reason
            self.refusals += 1
            log.warning("refusing index version %s: %s; still serving version %s", name,
                        reason, served)
        self._refused = (name, reason)
        return Outcome(served, refused=reason)

    async def poll(self, interval: float) -> None:
        """Check every `interval` seconds until cancelled (the app's lifespan)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await to_thread.run_sync(self.check)
            except Exception:  # noqa: BLE001 - the poller must outlive any one failure
                log.exception("index reload check failed")
