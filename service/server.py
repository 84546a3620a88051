"""The uvicorn server of `python -m service`: connection timeouts, header size bound, the cap
on open connections and graceful shutdown.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and bounds the size of
request headers (`h11_max_incomplete_event_size`), but has no time limit on receiving them:
a client sending one header byte every few seconds holds its connection forever. The
protocol below closes a connection whose request headers are not complete within
`header_timeout` seconds of its opening or of the previous response. The body has its own
deadline and pace (`service.middleware.BodyLimitMiddleware`, 408). A request that finds
`max_connections` connections open is answered 503 by uvicorn (`limit_concurrency`, a plain
text body) and its connection closed.

`Server` drains on SIGTERM or SIGINT (service.shutdown): new requests are answered 503 while
the admitted ones finish, then uvicorn stops; the process exits 0 (uvicorn would raise the
signal again after its shutdown, ending the process with the signal's status).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.settings import Settings
from service.shutdown import Drain

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        # IDLE: no complete request line and headers since the timer was armed.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def server_config(app: FastAPI, settings: Settings, **overrides) -> uvicorn.Config:
    """uvicorn settings of the service: timeouts and limits from `settings`."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                    {"header_timeout": settings.header_timeout})
    options = dict(host=settings.host, port=settings.port, log_level=settings.log_level,
                   access_log=False, http=protocol,
                   timeout_keep_alive=settings.keep_alive_timeout,
                   h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                   limit_concurrency=settings.max_connections,
                   # after the drain: what is left are idle keep-alive connections
                   timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)))
    return uvicorn.Config(app, **{**options, **overrides})


class Server(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or SIGINT (`drain`), stopping at once
    on the second."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT) and not self.drain.draining:
            self.drain.start()  # on_tick stops the server once the drain is done
            return
        log.warning("second signal %s: stopping now", signal.Signals(sig).name)
        self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done():
            self.should_exit = True
        return await super().on_tick(counter)
