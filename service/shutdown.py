"""Graceful shutdown: on SIGTERM (or SIGINT) the service stops admitting requests (503 with
`Connection: close`), lets the requests already inside finish for up to `shutdown_timeout`
seconds, then stops (service.server.Server) and exits 0. A second signal stops at once."""

from __future__ import annotations

import logging
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the service is shutting down; retry on another instance"


class Drain:
    """Requests inside the app now, and whether the service is draining (no new ones)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.in_flight = 0  # one event loop: no lock needed
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
            log.info("shutting down: %d requests in progress, waiting up to %gs for them",
                     self.in_flight, self.timeout)

    def done(self) -> bool:
        """Draining and no request left inside, or out of time."""
        if self.deadline is None:
            return False
        if self.in_flight and time.monotonic() >= self.deadline:
            log.warning("shutdown timeout: %d requests still in progress are cut",
                        self.in_flight)
            return True
        return self.in_flight == 0


class DrainMiddleware:
    """Counts the requests inside; while draining, answers new ones 503."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining:
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
