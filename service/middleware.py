"""ASGI middleware at the edge: request body size limit and access log with latency."""

from __future__ import annotations

import logging
import time

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("service.access")


class BodyLimitMiddleware:
    """Refuse bodies over `limit` bytes: by Content-Length up front, else while streaming."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            detail = f"request body of {int(length)} bytes is over the limit of {self.limit}"
            return await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                # Raised inside body parsing; FastAPI re-raises HTTPExceptions from there.
                raise HTTPException(413, f"request body is over the limit of {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


class AccessLogMiddleware:
    """One log line per request: method, path, status, latency in ms."""

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
            path = scope["path"] + (f"?{query}" if query else "")
            ms = 1000 * (time.perf_counter() - start)
            access_log.info("%s %s %d %.1fms", scope["method"], path, status, ms)
