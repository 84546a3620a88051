"""What the edge needs to know about a route, declared on the route itself.

    @router.post("/retrieve")
    @policy(body=lambda s: s.max_upload_bytes + MULTIPART_OVERHEAD, admitted=True)
    async def retrieve(...): ...

`body` is the largest request body the route takes (a function of the settings; default
SMALL_BODY_BYTES), `files` the most files a multipart body may hold (default none; FORM_FIELDS
other parts are allowed beside them), `admitted` counts its requests against `max_pending`
(503 beyond it) once their body is in, `public` leaves it open when API keys are on,
`signed` also opens it to a signed URL and `admin` closes it to all but admin keys
(service.auth). The middleware (service.middleware) reads the
policies from the app's routes, so a new route is written in one place: its router.
A path that matches no route gets the default policy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi.routing import iter_route_contexts
from starlette.routing import BaseRoute, Mount, compile_path
from starlette.types import Scope

from service.settings import SMALL_BODY_BYTES, Settings

# Multipart parts other than files a body may hold (none of the routes reads one; a client
# may send a few, e.g. a browser form's button).
FORM_FIELDS = 8

ATTRIBUTE = "edge_policy"
UNMATCHED = "unmatched"  # the route label of paths that match no route


@dataclass(frozen=True)
class Policy:
    body: Callable[[Settings], int] = lambda settings: SMALL_BODY_BYTES
    admitted: bool = False
    public: bool = False
    signed: bool = False
    files: Callable[[Settings], int] = lambda settings: 0
    admin: bool = False


DEFAULT = Policy()


def policy(body: Callable[[Settings], int] | None = None, admitted: bool = False,
           public: bool = False, signed: bool = False,
           files: Callable[[Settings], int] | None = None, admin: bool = False) -> Callable:
    """Decorator of a route's endpoint (or a mounted app) declaring its Policy."""
    declared = Policy(body or DEFAULT.body, admitted, public, signed, files or DEFAULT.files,
                      admin)

    def declare(target: Any) -> Any:
        setattr(target, ATTRIBUTE, declared)
        return target

    return declare


@dataclass(frozen=True)
class Rule:
    """A route's policy with the settings applied: body limit in bytes, the most parts of
    a multipart body."""

    name: str  # the route's path template, e.g. "/photos/{photo_id}" (a metrics label)
    body: int
    admitted: bool
    public: bool
    signed: bool
    parts: int
    admin: bool


class RouteTable:
    """Path -> Rule for the routes of an app, built on the first request (so routes added
    after `create_app` count) from the policies their endpoints declare."""

    def __init__(self, routes: Callable[[], Iterable[BaseRoute]], settings: Settings):
        self._routes = routes
        self._settings = settings
        self._rules: list[tuple[re.Pattern, frozenset[str] | None, Rule]] | None = None
        self.default = self._rule(UNMATCHED, DEFAULT)

    def _rule(self, name: str, declared: Policy) -> Rule:
        return Rule(name, int(declared.body(self._settings)), declared.admitted, declared.public,
                    declared.signed, int(declared.files(self._settings)) + FORM_FIELDS,
                    declared.admin)

    def _build(self) -> list[tuple[re.Pattern, frozenset[str] | None, Rule]]:
        rules = []
        for route in iter_route_contexts(list(self._routes())):  # included routers' too
            if isinstance(route.original_route, Mount):  # e.g. /static: all below the prefix
                declared = getattr(route.original_route.app, ATTRIBUTE, DEFAULT)
                prefix = re.compile("^" + re.escape(route.path) + "(/.*)?$")
                rules.append((prefix, None, self._rule(route.path, declared)))
            elif route.path is not None:
                declared = getattr(route.endpoint, ATTRIBUTE, DEFAULT)
                methods = frozenset(route.methods) if route.methods else None
                regex = compile_path(route.path)[0]
                rules.append((regex, methods, self._rule(route.path, declared)))
        return rules

    def rule(self, scope: Scope) -> Rule:
        """The rule of the request's path (cached in the scope for the next middleware)."""
        found = scope.get(ATTRIBUTE)
        if found is not None:
            return found
        if self._rules is None:
            self._rules = self._build()
        path, method = scope["path"], scope.get("method", "GET")
        found = next((rule for regex, methods, rule in self._rules
                      if regex.match(path) and (methods is None or method in methods)),
                     self.default)
        scope[ATTRIBUTE] = found
        return found
