"""ASGI middleware at the edge: admission cap, request body limits and timeout, and the
access log with latency."""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("service.access")
# On answers given before the body was read: the rest of it must not be parsed as the next
# request, and the connection is not kept for a client that stalls or sends too much.
CLOSE = {"Connection": "close"}


def printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped (``\\n`` ->
    ``\\x0a``), so a request path cannot forge or break a log line."""
    return "".join(c if c.isprintable() and c != "\\" else f"\\x{ord(c):02x}" if ord(c) < 256
                   else c.encode("unicode_escape").decode("ascii") for c in text)


class AdmissionMiddleware:
    """At most ``limit`` requests to ``paths`` at once; more are answered 503 with
    ``Retry-After`` before their body is read, so a burst can neither queue unbounded nor
    hold its uploads in memory."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...], limit: int, retry_after: int = 1):
        self.app = app
        self.paths = paths
        self.limit = limit
        self.retry_after = retry_after
        self.active = 0  # one event loop: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            detail = f"busy: {self.active} retrievals in progress; retry after {self.retry_after}s"
            response = JSONResponse({"detail": detail}, status_code=503,
                                    headers={"Retry-After": str(self.retry_after)})
            return await response(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class BodyLimitMiddleware:
    """Refuse bodies over the path's limit: by Content-Length before any byte of the body is
    read, else while streaming; and a body not received within ``timeout`` seconds is 408."""

    def __init__(self, app: ASGIApp, limits: dict[str, int], default: int, timeout: float):
        self.app = app
        self.limits = limits
        self.default = default
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.get(scope["path"], self.default)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            detail = f"request body of {int(length)} bytes is over the limit of {limit}"
            response = JSONResponse({"detail": detail}, status_code=413, headers=CLOSE)
            return await response(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        seen = 0
        done = False

        async def limited() -> Message:
            nonlocal seen, done
            if done:  # after the body: a wait for the disconnect, not timed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"request body not received within {self.timeout:g}s "
                                         f"({seen} bytes arrived)", headers=CLOSE) from None
            seen += len(message.get("body", b""))
            done = not message.get("more_body", False)
            if seen > limit:
                # Raised inside body parsing; FastAPI re-raises HTTPExceptions from there.
                raise HTTPException(413, f"request body is over the limit of {limit} bytes",
                                    headers=CLOSE)
            return message

        await self.app(scope, limited, send)


class AccessLogMiddleware:
    """One log line per request: method, path (control characters escaped), status, latency."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            query = scope.get("query_string", b"").decode("latin-1")
            path = printable(scope["path"] + (f"?{query}" if query else ""))
            ms = 1000 * (time.perf_counter() - start)
            access_log.info("%s %s %d %.1fms", printable(scope["method"]), path, status, ms)
