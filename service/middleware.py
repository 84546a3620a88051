"""ASGI middleware at the edge: request bodies (size, pace, parts, uploads per client), the
admission cap, and the access log with latency. What applies to a path comes from its
route's declared policy (service.policy).

A request counts against the admission cap only once its body is in: a client that sends
its body slowly holds a connection (bounded per client address and in all) but no
admission slot, and is answered 408 when it falls behind the minimum pace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import unquote_plus

from python_multipart.multipart import parse_options_header
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth import KEY_SCOPE
from service.policy import RouteTable

access_log = logging.getLogger("service.access")
# On answers given before the body was read: the rest of it must not be parsed as the next
# request, and the connection is not kept for a client that stalls or sends too much.
CLOSE = {"Connection": "close"}
# The least time given to a receive past the deadline: a message already queued is taken
# (time the service spent parsing is not the client's).
MIN_WAIT = 0.001
RETRY_AFTER = 1


def printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped (``\\n`` ->
    ``\\x0a``), so a request path cannot forge or break a log line."""
    return "".join(c if c.isprintable() and c != "\\" else f"\\x{ord(c):02x}" if ord(c) < 256
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case), as Starlette reads it."""
    return next((v for k, v in scope.get("headers") or [] if k == name), None)


def has_body(scope: Scope) -> bool:
    """Whether the request has a body: a Content-Length above 0, or a Transfer-Encoding."""
    length = header(scope, b"content-length")
    return (length is not None and length.strip(b"0") != b"") or (
        header(scope, b"transfer-encoding") is not None)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "-"


class Admission:
    """The count of admitted requests (routes declared `admitted`) and of those refused."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0  # one event loop: no lock needed
        self.admitted = 0
        self.rejected = 0

    def busy(self) -> str:
        return f"busy: {self.active} retrievals in progress; retry after {RETRY_AFTER}s"


class AdmissionMiddleware:
    """At most ``admission.limit`` requests to routes declared `admitted` at once, counted
    from the moment their body is in (a request without a body: from its start) until the
    answer; more are answered 503 with ``Retry-After``. Refusing after the body keeps the
    connection usable, and a slow upload costs no slot (service.middleware's docstring)."""

    def __init__(self, app: ASGIApp, table: RouteTable, admission: Admission):
        self.app = app
        self.table = table
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.table.rule(scope).admitted:
            return await self.app(scope, receive, send)
        state = self.admission
        admitted = False

        def admit() -> bool:
            nonlocal admitted
            if state.active >= state.limit:
                state.rejected += 1
                return False
            state.active += 1
            state.admitted += 1
            admitted = True
            return True

        async def admitting() -> Message:
            message = await receive()
            if (not admitted and message["type"] == "http.request"
                    and not message.get("more_body", False) and not admit()):
                # Raised inside body parsing; FastAPI re-raises HTTPExceptions from there.
                raise HTTPException(503, state.busy(),
                                    headers={"Retry-After": str(RETRY_AFTER)})
            return message

        if not has_body(scope) and not admit():
            response = JSONResponse({"detail": state.busy()}, status_code=503,
                                    headers={"Retry-After": str(RETRY_AFTER)})
            return await response(scope, receive, send)
        try:
            await self.app(scope, receive if admitted else admitting, send)
        finally:
            if admitted:
                state.active -= 1


class Uploads:
    """Requests whose body is still arriving, by client address (`limit` each at most)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.by_client: dict[str, int] = {}  # one event loop: no lock needed
        self.refused = 0

    def start(self, client: str) -> bool:
        count = self.by_client.get(client, 0)
        if count >= self.limit:
            self.refused += 1
            return False
        self.by_client[client] = count + 1
        return True

    def end(self, client: str) -> None:
        count = self.by_client.pop(client) - 1
        if count:
            self.by_client[client] = count


class PartCounter:
    """Counts the parts of a multipart body as it streams in, before the form parser sees
    them: a part starts at each CRLF + ``--`` + boundary that is not the closing delimiter
    (followed by ``--``)."""

    def __init__(self, boundary: bytes, limit: int):
        self.delimiter = b"\r\n--" + boundary
        self.limit = limit
        self.parts = 0
        self._pending = b"\r\n"  # the body's first delimiter has no CRLF of its own

    @classmethod
    def of(cls, scope: Scope, limit: int) -> PartCounter | None:
        """A counter for a multipart/form-data body (the boundary read as Starlette reads
        it); None for any other body."""
        kind, options = parse_options_header(header(scope, b"content-type") or b"")
        boundary = options.get(b"boundary")
        return cls(boundary, limit) if kind == b"multipart/form-data" and boundary else None

    def feed(self, chunk: bytes) -> bool:
        """Count the parts that start in `chunk`; whether the body is still within limit."""
        data = self._pending + chunk
        n = len(self.delimiter)
        start = 0
        # A delimiter is counted once the 2 bytes after it are in (they tell the closing one)
        while (i := data.find(self.delimiter, start)) != -1 and i + n + 2 <= len(data):
            self.parts += data[i + n:i + n + 2] != b"--"
            start = i + n
        # Keep what may hold the start of a delimiter not yet counted.
        self._pending = data[max(start, len(data) - n - 1):]
        return self.parts <= self.limit


class BodyLimitMiddleware:
    """What a request body may be:

    - over the route's limit: 413, by Content-Length before any byte of it is read, else
      while streaming;
    - slow: a body must have ``(t - timeout) x min_rate`` bytes in at t seconds from its
      start (so n bytes have ``timeout + n / min_rate`` seconds); one that falls behind is
      408;
    - multipart with more parts than the route's ``parts``: 413 as they stream in, before
      the form parser sees the part over the limit;
    - a client address with ``uploads.limit`` bodies arriving already: 429 before its body
      is read.
    """

    def __init__(self, app: ASGIApp, table: RouteTable, timeout: float, min_rate: float,
                 uploads: Uploads):
        self.app = app
        self.table = table
        self.timeout = timeout
        self.min_rate = min_rate
        self.uploads = uploads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rule = self.table.rule(scope)
        limit = rule.body
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            detail = f"request body of {int(length)} bytes is over the limit of {limit}"
            response = JSONResponse({"detail": detail}, status_code=413, headers=CLOSE)
            return await response(scope, receive, send)
        if not has_body(scope):
            return await self.app(scope, receive, send)
        client = client_address(scope)
        if not self.uploads.start(client):
            detail = (f"too many uploads in progress from {client}: {self.uploads.limit} at "
                      f"most; retry after {RETRY_AFTER}s")
            response = JSONResponse({"detail": detail}, status_code=429,
                                    headers={**CLOSE, "Retry-After": str(RETRY_AFTER)})
            return await response(scope, receive, send)
        counter = PartCounter.of(scope, rule.parts)
        loop = asyncio.get_running_loop()
        start = loop.time()
        seen = 0
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.uploads.end(client)

        async def limited() -> Message:
            nonlocal seen
            if done:  # after the body: a wait for the disconnect, not timed
                return await receive()
            deadline = start + self.timeout + seen / self.min_rate
            try:
                message = await asyncio.wait_for(receive(),
                                                 max(deadline - loop.time(), MIN_WAIT))
            except asyncio.TimeoutError:
                finish()
                raise HTTPException(
                    408, f"request body too slow: {seen} bytes in {loop.time() - start:.1f}s; "
                         f"a body must arrive within {self.timeout:g}s + 1s per "
                         f"{self.min_rate:g} bytes", headers=CLOSE) from None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if message["type"] != "http.request" or not message.get("more_body", False):
                finish()  # the whole body, or the client is gone
            if seen > limit:
                # Raised inside body parsing; FastAPI re-raises HTTPExceptions from there.
                raise HTTPException(413, f"request body is over the limit of {limit} bytes",
                                    headers=CLOSE)
            if counter is not None and not counter.feed(chunk):
                raise HTTPException(413, f"multipart body of more than {counter.limit} parts",
                                    headers=CLOSE)
            return message

        try:
            await self.app(scope, limited, send)
        finally:
            finish()


def without_signature(query: str) -> str:
    """The query string with the value of `sig` (a signed URL's signature, service.auth)
    cut; names are decoded as the signature check decodes them."""
    parts = query.split("&")
    for i, part in enumerate(parts):
        name, eq, value = part.partition("=")
        if eq and unquote_plus(name) == "sig":
            parts[i] = f"{name}=-"
    return "&".join(parts)


class AccessLogMiddleware:
    """One log line per request: client address, what opened it (`key=` a key id, signed,
    invalid or -), method, path (signature cut, control characters escaped), status,
    latency."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        def log(status: int, seconds: float) -> None:
            query = without_signature(scope.get("query_string", b"").decode("latin-1"))
            path = printable(scope["path"] + (f"?{query}" if query else ""))
            access_log.info("%s key=%s %s %s %d %.1fms", printable(client_address(scope)),
                            scope.get(KEY_SCOPE) or "-", printable(scope["method"]), path,
                            status, 1000 * seconds)

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
