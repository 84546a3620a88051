"""ASGI middleware at the edge: admission cap, request body limits and timeout, and the
access log with latency. What applies to a path comes from its route's declared policy
(service.policy)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.policy import RouteTable

access_log = logging.getLogger("service.access")
# On answers given before the body was read: the rest of it must not be parsed as the next
# request, and the connection is not kept for a client that stalls or sends too much.
CLOSE = {"Connection": "close"}


def printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped (``\\n`` ->
    ``\\x0a``), so a request path cannot forge or break a log line."""
    return "".join(c if c.isprintable() and c != "\\" else f"\\x{ord(c):02x}" if ord(c) < 256
                   else c.encode("unicode_escape").decode("ascii") for c in text)


class Admission:
    """The count of admitted requests (routes declared `admitted`) and of those refused."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0  # one event loop: no lock needed
        self.admitted = 0
        self.rejected = 0


class AdmissionMiddleware:
    """At most ``admission.limit`` requests to routes declared `admitted` at once; more are
    answered 503 with ``Retry-After`` before their body is read, so a burst can neither
    queue unbounded nor hold its uploads in memory."""

    def __init__(self, app: ASGIApp, table: RouteTable, admission: Admission,
                 retry_after: int = 1):
        self.app = app
        self.table = table
        self.admission = admission
        self.retry_after = retry_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.table.rule(scope).admitted:
            return await self.app(scope, receive, send)
        state = self.admission
        if state.active >= state.limit:
            state.rejected += 1
            detail = (f"busy: {state.active} retrievals in progress; retry after "
                      f"{self.retry_after}s")
            response = JSONResponse({"detail": detail}, status_code=503,
                                    headers={"Retry-After": str(self.retry_after)})
            return await response(scope, receive, send)
        state.active += 1
        state.admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.active -= 1


class BodyLimitMiddleware:
    """Refuse bodies over the route's limit: by Content-Length before any byte of the body is
    read, else while streaming; and a body not received within ``timeout`` seconds is 408."""

    def __init__(self, app: ASGIApp, table: RouteTable, timeout: float):
        self.app = app
        self.table = table
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.table.rule(scope).body
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

        def log(status: int, seconds: float) -> None:
            query = scope.get("query_string", b"").decode("latin-1")
            path = printable(scope["path"] + (f"?{query}" if query else ""))
            access_log.info("%s %s %d %.1fms", printable(scope["method"]), path, status,
                            1000 * seconds)

        await timed(self.app, scope, receive, send, log)


async def timed(app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                done: Callable[[int, float], None]) -> None:
    """Run `app` on one request, then call `done(status, seconds)`, also when it raises
    (status 500 where no response was started)."""
    start = time.perf_counter()
    status = 500

    async def send_status(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        await app(scope, receive, send_status)
    finally:
        done(status, time.perf_counter() - start)
