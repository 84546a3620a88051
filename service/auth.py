"""API keys: optional (none configured: every route open, the local demo), required on every
route a policy does not declare `public` when any key is configured.

A key is sent as `X-API-Key: KEY` (or `Authorization: Bearer KEY`). A key is compared as its
SHA-256 digest against every configured key's digest with `hmac.compare_digest` (equal
lengths, no early exit, every key tried), so the time taken says nothing about how close a
wrong key was or how long it is. Routes declared `signed` (the photo files) also take a
short-lived signed URL (`?expires=UNIX_TIME&sig=HEX`), which is what retrieval results link
to when keys are on, so that `<img src>` works without headers. The signing key is derived
from the configured keys, so replicas with the same keys accept each other's URLs.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.policy import RouteTable
from service.settings import Settings

UNAUTHORIZED = "a valid API key is required: send it in the X-API-Key header"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def read_keys(settings: Settings) -> list[str]:
    """The keys of `api_keys` and of `api_keys_file` (one a line; blank lines and lines
    starting with # skipped). A key file that cannot be read, or holds no key, is an error
    naming it: a service meant to need keys must not start open."""
    keys = [k for k in settings.api_keys if k]
    if settings.api_keys_file is not None:
        path = settings.api_keys_file
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ValueError(f"cannot read the API key file {str(path)!r}: {err}") from err
        found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"the API key file {str(path)!r} holds no key")
        keys += found
    return keys


class Keys:
    """The configured keys (as digests) and the signing of photo URLs."""

    def __init__(self, keys: list[str], url_ttl: int = 300,
                 clock: Callable[[], float] = time.time):
        self._digests = [_digest(k) for k in keys]
        self._sign_key = hashlib.sha256(
            b"sketchsvd photo urls\n" + b"\n".join(sorted(_digest(k) for k in keys))).digest()
        self.url_ttl = url_ttl
        self.clock = clock

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def valid(self, key: str | None) -> bool:
        """Whether `key` is one of the keys; the same work for any key, right or wrong."""
        digest = _digest(key or "")
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(digest, known)
        return found and key is not None

    def _signature(self, path: str, expires: int) -> str:
        message = f"{path}\n{expires}".encode("utf-8", "surrogateescape")
        return hmac.new(self._sign_key, message, hashlib.sha256).hexdigest()

    def sign(self, path: str) -> str:
        """`path` with the query string that opens it for `url_ttl` seconds."""
        expires = int(self.clock()) + self.url_ttl
        return f"{path}?{urlencode({'expires': expires, 'sig': self._signature(path, expires)})}"

    def signed(self, path: str, query: str) -> bool:
        """Whether the query string holds an unexpired signature of `path`."""
        params = parse_qs(query)
        try:
            (expires,), (sig,) = params["expires"], params["sig"]
            when = int(expires)
        except (KeyError, ValueError):
            return False
        good = hmac.compare_digest(sig.encode(), self._signature(path, when).encode())
        return good and self.clock() <= when


def presented_key(scope: Scope) -> str | None:
    """The key a request sends: X-API-Key, else an Authorization Bearer token."""
    headers = dict(scope.get("headers") or [])
    key = headers.get(b"x-api-key")
    if key is None:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        key = token.strip() if scheme.lower() == b"bearer" else None
    return None if key is None else key.decode("latin-1")


class AuthMiddleware:
    """401, in the one error shape and before any body byte is read, for requests without a
    valid key to routes that are not public (when keys are on)."""

    def __init__(self, app: ASGIApp, table: RouteTable, keys: Keys):
        self.app = app
        self.table = table
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled:
            return await self.app(scope, receive, send)
        rule = self.table.rule(scope)
        query = scope.get("query_string", b"").decode("latin-1")
        if (rule.public or self.keys.valid(presented_key(scope))
                or (rule.signed and self.keys.signed(scope["path"], query))):
            return await self.app(scope, receive, send)
        response = JSONResponse({"detail": UNAUTHORIZED}, status_code=401,
                                headers={"WWW-Authenticate": "ApiKey"})
        await response(scope, receive, send)
