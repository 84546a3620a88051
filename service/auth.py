"""API keys: optional (none configured: every route open, the local demo), required on every
route a policy does not declare `public` when any key is configured; admin keys for the
routes declared `admin` (/admin/*).

A key is sent as `X-API-Key: KEY` (or `Authorization: Bearer KEY`). A key is compared as its
SHA-256 digest against every configured key's digest, API and admin keys alike, with
`hmac.compare_digest` (equal lengths, no early exit, every key tried), so the time taken
says nothing about how close a wrong key was, how long it is or which kind it would be.
Routes declared `signed` (the photo files) also take a short-lived signed URL
(`?expires=UNIX_TIME&sig=HEX`), which is what retrieval results link to when keys are on, so
that `<img src>` works without headers. The signing key is derived from the configured API
keys, so replicas with the same keys accept each other's URLs.

Admin keys are a set of their own: an admin key opens every route, an API key every route
but the `admin` ones. With API keys and no admin key, the `admin` routes are closed (403): a
key handed to a client never reloads the index. With no key of either kind everything is
open, and the Origin check (service.guard) keeps other sites' pages from POSTing.

The access log names a request's key by its id (`key_id`: the first 8 hex digits of its
SHA-256), never by the key.
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
ADMIN_UNAUTHORIZED = "an admin key is required: send it in the X-API-Key header"
ADMIN_ONLY = "this route needs an admin key, not an API key"
NO_ADMIN_KEY = ("this route needs an admin key and none is configured (ADMIN_KEYS or "
                "ADMIN_KEYS_FILE)")
# What the access log records of a request's key (service.middleware.AccessLogMiddleware).
KEY_SCOPE = "sketchsvd.key"
INVALID, SIGNED = "invalid", "signed"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def key_id(key: str) -> str:
    """The name a key goes by in the log: the first 8 hex digits of its SHA-256
    (`printf %s KEY | sha256sum | cut -c1-8`)."""
    return _digest(key).hex()[:8]


def _read(listed: list[str], file: Path | None, setting: str, kind: str) -> list[str]:
    """The keys of a list setting and of its file; an empty or blank key, or one with
    spaces around it (no header can carry those), is an error naming the setting."""
    for i, key in enumerate(listed):
        if not key.strip():
            raise ValueError(
                f"{setting} (SKETCHSVD_{setting.upper()}) holds an empty key (item {i + 1} of "
                f"{len(listed)}), as an unset variable in '[\"${{KEY}}\"]' gives: refusing "
                "to start a service that would be open; remove it or set the key")
        if key != key.strip():
            raise ValueError(f"{setting} (SKETCHSVD_{setting.upper()}): item {i + 1} of "
                             f"{len(listed)} has spaces around it, which no header can carry")
    keys = list(listed)
    if file is not None:
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ValueError(f"cannot read the {kind} file {str(file)!r}: {err}") from err
        found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"the {kind} file {str(file)!r} holds no key")
        keys += found
    return keys


def read_keys(settings: Settings) -> list[str]:
    """The API keys of `api_keys` and of `api_keys_file` (one a line; blank lines and lines
    starting with # skipped). A key file that cannot be read or holds no key, and an empty
    key in `api_keys`, are errors naming them: a service meant to need keys must not start
    open."""
    return _read(settings.api_keys, settings.api_keys_file, "api_keys", "API key")


def read_admin_keys(settings: Settings) -> list[str]:
    """The admin keys of `admin_keys` and `admin_keys_file`, checked as `read_keys` does; a
    key that is also an API key is an error (the roles would be one)."""
    admin = _read(settings.admin_keys, settings.admin_keys_file, "admin_keys", "admin key")
    shared = set(admin) & set(read_keys(settings))
    if shared:
        raise ValueError(f"{len(shared)} admin key(s) are also API keys (id "
                         f"{', '.join(sorted(key_id(k) for k in shared))}): give admins keys "
                         "of their own")
    return admin


class Keys:
    """The configured keys (as digests) and the signing of photo URLs."""

    def __init__(self, keys: list[str], url_ttl: int = 300,
                 clock: Callable[[], float] = time.time, admin: list[str] = ()):
        self._digests = [_digest(k) for k in keys]
        self._admin = [_digest(k) for k in admin]
        self._sign_key = hashlib.sha256(
            b"sketchsvd photo urls\n" + b"\n".join(sorted(_digest(k) for k in keys))).digest()
        self.url_ttl = url_ttl
        self.clock = clock

    @property
    def enabled(self) -> bool:
        """Whether API keys are on (every route but the public ones needs a key)."""
        return bool(self._digests)

    @property
    def admin_enabled(self) -> bool:
        return bool(self._admin)

    def role(self, key: str | None) -> str | None:
        """"admin", "api" or None for `key`; the same work for any key, right or wrong."""
        digest = _digest(key or "")
        api = admin = False
        for known in self._digests:
            api |= hmac.compare_digest(digest, known)
        for known in self._admin:
            admin |= hmac.compare_digest(digest, known)
        if key is None:
            return None
        return "admin" if admin else "api" if api else None

    def valid(self, key: str | None) -> bool:
        """Whether `key` is one of the keys (API or admin); the same work for any key."""
        return self.role(key) is not None

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
    """401 (no valid key) or 403 (an API key on an admin route), in the one error shape and
    before any body byte is read. Records what opened the request in the scope for the
    access log (KEY_SCOPE: a key id, "signed", "invalid" or None)."""

    def __init__(self, app: ASGIApp, table: RouteTable, keys: Keys):
        self.app = app
        self.table = table
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys
        if scope["type"] != "http" or not (keys.enabled or keys.admin_enabled):
            return await self.app(scope, receive, send)
        rule = self.table.rule(scope)
        key = presented_key(scope)
        role = keys.role(key)
        scope[KEY_SCOPE] = key_id(key) if role else (INVALID if key is not None else None)
        if rule.admin:
            refusal = (None if role == "admin"
                       else (403, ADMIN_ONLY if keys.admin_enabled else NO_ADMIN_KEY)
                       if role == "api" else (401, ADMIN_UNAUTHORIZED))
        elif not keys.enabled or rule.public or role is not None:
            refusal = None
        elif rule.signed and keys.signed(scope["path"],
                                         scope.get("query_string", b"").decode("latin-1")):
            scope[KEY_SCOPE] = SIGNED
            refusal = None
        else:
            refusal = (401, UNAUTHORIZED)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, detail = refusal
        headers = {"WWW-Authenticate": "ApiKey"} if status == 401 else None
        await JSONResponse({"detail": detail}, status_code=status, headers=headers)(
            scope, receive, send)
