"""Graceful shutdown: on SIGTERM (or SIGINT) the service stops admitting requests (503 with
`Connection: close`), lets the requests already inside finish for up to `shutdown_timeout`
seconds, then stops (service.server.Server) and exits 0. A second signal stops at once.

The server stops only after QUIET seconds without a request: a client whose keep-alive
connection got its last answer before the signal may be sending its next request as the
server closes its connections, and that request would be cut. While draining, such a request
gets its 503 with `Connection: close` instead; the quiet period lets every active client hear
it."""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the service is shutting down; retry on another instance"
QUIET = 0.5  # seconds without a request before a drained server stops
# A refused request's body is read (up to this much, for at most this long) before the 503:
# closing a connection with unread bytes resets it, and the client may lose the answer.
DISCARD_BYTES, DISCARD_SECONDS = 8 << 20, 1.0


class Drain:
    """Requests inside the app now, and whether the service is draining (no new ones)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.in_flight = 0  # one event loop: no lock needed
        self.deadline: float | None = None
        self.last_request = 0.0  # monotonic time of the latest request (admitted or not)

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
            self.last_request = time.monotonic()
            log.info("shutting down: %d requests in progress, waiting up to %gs for them",
                     self.in_flight, self.timeout)

    def done(self) -> bool:
        """Draining, no request left inside and none for QUIET seconds; or out of time."""
        if self.deadline is None:
            return False
        now = time.monotonic()
        if now >= self.deadline:
            if self.in_flight:
                log.warning("shutdown timeout: %d requests still in progress are cut",
                            self.in_flight)
            return True
        return self.in_flight == 0 and now - self.last_request >= min(QUIET, self.timeout)


class DrainMiddleware:
    """Counts the requests inside; while draining, answers new ones 503."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.drain.last_request = time.monotonic()
        if self.drain.draining:
            try:
                await asyncio.wait_for(_discard_body(receive), DISCARD_SECONDS)
            except TimeoutError:
                pass
            response = JSONResponse({"detail": SHUTTING_DOWN}, status_code=503,
                                    headers={"Connection": "close", "Retry-After": "1"})
            return await response(scope, receive, send)
        self.drain.in_flight += 1

        async def send_closing(message: Message) -> None:
            # An answer given while draining closes its connection: the client does not
            # send its next request on a connection about to be closed.
            if message["type"] == "http.response.start" and self.drain.draining:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, send_closing)
        finally:
            self.drain.in_flight -= 1


async def _discard_body(receive: Receive) -> None:
    """Read the request's body, up to DISCARD_BYTES, and drop it."""
    seen = 0
    while seen <= DISCARD_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
