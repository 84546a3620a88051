"""Defences against browsers used as the attacker's hands, and against saying too much:

- allowed hosts: a request must name a host the service answers to (``allowed_hosts``; by
  default one that arrives on a loopback address must name a loopback host), so a page whose
  DNS name is rebound to 127.0.0.1 cannot read a service that has no keys;
- the Origin check: with no API keys, a POST (any unsafe method) from a page of another
  origin is refused unless ``cors_origins`` lists it; a page can send one without asking
  (an HTML form), and without keys nothing else would stop it;
- security headers on every answer (nosniff, no referrer), and a content security policy
  that keeps the drawing page to its own scripts and out of other sites' frames;
- error bodies without server paths;
- the warning, at start and in /info, that a service listening beyond loopback has no keys.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.middleware import CLOSE, header
from service.settings import Settings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443}
# Every answer; the page adds PAGE_HEADERS (service.routes.web).
HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
PAGE_HEADERS = {
    # blob: the preview of an uploaded sketch (an object URL); no inline script or style
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' blob:; connect-src 'self'; form-action 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
}


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is loopback:
    localhost, a name under .localhost (RFC 6761: never sent to DNS), 127.0.0.0/8, ::1."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """(host, port or None) of a Host header value or an `allowed_hosts` entry: the host
    lower case, without a trailing dot or brackets, an IP address in its normal form
    (``[::1]:8000`` -> ``("::1", 8000)``, ``Example.org.`` -> ``("example.org", None)``)."""
    value = value.strip().lower()
    port = None
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = int(rest[1:]) if rest[:1] == ":" and rest[1:].isdigit() else None
    elif value.count(":") > 1:  # an IPv6 address without brackets (an allowed_hosts entry)
        name = value
    else:
        name, sep, tail = value.rpartition(":")
        if sep and tail.isdigit():
            port = int(tail)
        else:
            name = value
    name = name.rstrip(".")
    try:
        name = str(ipaddress.ip_address(name))
    except ValueError:
        pass
    return name, port


def host_allowed(name: str, allowed: list[str]) -> bool:
    """Whether host `name` (split_host's) matches an entry of `allowed`: ``*`` any,
    ``*.example.org`` its subdomains, else the host itself (a port in the entry is
    ignored)."""
    for entry in allowed:
        entry = entry.strip().lower()
        if entry == "*" or (entry.startswith("*.") and name.endswith(entry[1:])):
            return True
        if not entry.startswith("*") and split_host(entry)[0] == name:
            return True
    return False


class HostMiddleware:
    """400 for a Host header the service does not answer to (``allowed_hosts``; None: a
    request that arrives on a loopback address must name a loopback host, others any). A
    request without a Host header (HTTP/1.0) is no browser's and passes."""

    def __init__(self, app: ASGIApp, allowed: list[str] | None):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = header(scope, b"host") if scope["type"] == "http" else None
        if value is None:
            return await self.app(scope, receive, send)
        name = split_host(value.decode("latin-1"))[0]
        if self.allowed is not None:
            ok = host_allowed(name, self.allowed)
        else:
            server = scope.get("server")
            ok = not (server and is_loopback(str(server[0]))) or is_loopback(name)
        if ok:
            return await self.app(scope, receive, send)
        rule = "ALLOWED_HOSTS" if self.allowed is not None else (
            "a request to a loopback address must name a loopback host; ALLOWED_HOSTS")
        detail = f"host {name[:100]!r} is not one this service answers to ({rule})"
        await JSONResponse({"detail": detail}, status_code=400, headers=CLOSE)(
            scope, receive, send)


def same_origin(origin: str, host: str) -> bool:
    """Whether Origin `origin` (scheme://host[:port]) names the host and port of Host
    header `host` (a default port may be left out of either)."""
    parts = urlsplit(origin)
    try:
        origin_port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:  # a port that is no number
        return False
    name, port = split_host(host)
    return (parts.hostname is not None and split_host(parts.hostname)[0] == name
            and origin_port == (port or DEFAULT_PORTS.get(parts.scheme)))


class OriginMiddleware:
    """When the service has no API keys: 403 for an unsafe request (POST...) sent by a
    page of another origin (its Origin header, or `Sec-Fetch-Site: cross-site` where there
    is none) that ``cors_origins`` does not list. Requests without either header (curl,
    scripts, the Python client) pass: only a browser can be made to send one for a page."""

    def __init__(self, app: ASGIApp, allowed_origins: list[str], keys_enabled: bool):
        self.app = app
        self.allowed = frozenset(o.rstrip("/") for o in allowed_origins)
        self.keys_enabled = keys_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.keys_enabled
                or scope["method"] in SAFE_METHODS):
            return await self.app(scope, receive, send)
        origin = header(scope, b"origin")
        if origin is None:
            refused = header(scope, b"sec-fetch-site") == b"cross-site"
            shown = "a cross-site page"
        else:
            text = origin.decode("latin-1")
            host = (header(scope, b"host") or b"").decode("latin-1")
            refused = text not in self.allowed and not same_origin(text, host)
            shown = f"origin {text[:100]!r}"
        if not refused:
            return await self.app(scope, receive, send)
        detail = (f"cross-site request refused: {shown} is not this service's and not in "
                  "CORS_ORIGINS")
        await JSONResponse({"detail": detail}, status_code=403, headers=CLOSE)(
            scope, receive, send)


class HeadersMiddleware:
    """HEADERS on every answer that does not set them itself."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in HEADERS if k not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


# An absolute path: in quotes (spaces allowed), or a bare token starting at a word boundary.
_QUOTED_PATH = re.compile(r"""(['"])(/[^'"\n]*)\1""")
_BARE_PATH = re.compile(r"""(?<![\w./~-])/[^\s'",;()]+""")


def without_paths(text: str) -> str:
    """`text` with every absolute path shortened to its last component (``'/srv/runs/index'``
    -> ``'.../index'``): an error body names the file, not where the server keeps it."""
    def last(path: str) -> str:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        return f".../{name}" if name else "..."

    text = _QUOTED_PATH.sub(lambda m: m[1] + last(m[2]) + m[1], text)
    return _BARE_PATH.sub(lambda m: last(m[0]), text)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """FastAPI's answer to an HTTPException, its detail without server paths."""
    if isinstance(exc.detail, str):
        exc.detail = without_paths(exc.detail)
    return await http_exception_handler(request, exc)


def exposure_warnings(settings: Settings, keys_enabled: bool) -> list[str]:
    """What an operator must know about who can reach the service: listening beyond
    loopback (`host`) without API keys."""
    if keys_enabled or is_loopback(settings.host):
        return []
    return [f"listening on {settings.host}, beyond loopback, without API keys: anyone who "
            "can reach it can query it, read its photos and see its metrics; set API_KEYS "
            "or API_KEYS_FILE (in a container, the published address decides who can)"]
