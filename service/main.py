"""The FastAPI app: settings, lifespan loading, middleware, error shape, routers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from anyio import CapacityLimiter
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.auth import AuthMiddleware, Keys, read_admin_keys, read_keys
from service.guard import (
    HeadersMiddleware,
    HostMiddleware,
    OriginMiddleware,
    exposure_warnings,
    http_error,
)
from service.loading import load_engine
from service.metrics import Metrics, MetricsMiddleware
from service.middleware import (
    AccessLogMiddleware,
    Admission,
    AdmissionMiddleware,
    BodyLimitMiddleware,
    Uploads,
)
from service.policy import RouteTable
from service.reload import Reloader
from service.retrieval import RetrievalEngine
from service.routes import admin, photos, retrieve, system, web
from service.settings import Settings
from service.shutdown import Drain, DrainMiddleware

log = logging.getLogger(__name__)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 in the one error shape, {"detail": str}; names the field, never echoes its value
    (which may be the bytes of an upload)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return JSONResponse({"detail": "; ".join(parts)}, status_code=422)


def schema_with_bounds(app: FastAPI, settings: Settings) -> dict:
    """The OpenAPI schema with the bounds that depend on the settings (k <= max_k) and on
    the loaded index (dims <= stored dims) written into every operation's `k` and `dims`
    query parameters. Cached until the index changes (`app.openapi_schema = None`)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    engine = app.state.engine
    maxima = {"k": settings.max_k, "dims": engine.dims if engine is not None else None}
    for operations in schema["paths"].values():
        for operation in operations.values():
            for param in operation.get("parameters", []):
                bound = maxima.get(param["name"]) if param.get("in") == "query" else None
                if bound is None:
                    continue
                for option in param["schema"].get("anyOf", [param["schema"]]):
                    if option.get("type") == "integer":
                        option["maximum"] = bound
    if engine is not None:  # dims is final only once the index is loaded
        app.openapi_schema = schema
    return schema


def create_app(
    settings: Settings | None = None,
    loader: Callable[[Settings], RetrievalEngine] = load_engine,
) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="sketchsvd retrieval", version="0.1.0",
                  lifespan=_lifespan(settings, loader))
    state = app.state
    state.settings = settings
    state.engine = None
    state.reloader = None
    # The one bound on retrievals computing at once: waiting for it happens on the event
    # loop (service.routes.retrieve), so waiting requests hold no thread.
    state.slots = CapacityLimiter(settings.inference_slots)
    state.admission = Admission(settings.max_pending)
    state.uploads = Uploads(settings.max_uploads_per_client)
    state.keys = Keys(read_keys(settings), settings.signed_url_ttl,
                      admin=read_admin_keys(settings))
    state.warnings = exposure_warnings(settings, state.keys.enabled)
    state.metrics = Metrics(state)
    state.drain = Drain(settings.shutdown_timeout)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.openapi = lambda: schema_with_bounds(app, settings)
    table = RouteTable(lambda: app.routes, settings)
    # Outermost last: access log, metrics, headers, allowed hosts, CORS, Origin check,
    # drain, keys, body (size, pace, parts, uploads per client), admission (once the body
    # is in).
    app.add_middleware(AdmissionMiddleware, table=table, admission=state.admission)
    app.add_middleware(BodyLimitMiddleware, table=table, timeout=settings.body_timeout,
                       min_rate=settings.body_min_rate, uploads=state.uploads)
    app.add_middleware(AuthMiddleware, table=table, keys=state.keys)
    app.add_middleware(DrainMiddleware, drain=state.drain)
    app.add_middleware(OriginMiddleware, allowed_origins=settings.cors_origins,
                       keys_enabled=state.keys.enabled)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(HostMiddleware, allowed=settings.allowed_hosts)
    app.add_middleware(HeadersMiddleware)
    app.add_middleware(MetricsMiddleware, table=table, metrics=state.metrics)
    app.add_middleware(AccessLogMiddleware)
    for router in (retrieve.router, photos.router, system.router, admin.router, web.router):
        app.include_router(router)
    app.mount("/static", web.static_files(), name="static")
    return app


def _lifespan(settings: Settings, loader: Callable[[Settings], RetrievalEngine]):
    """Load the engine at startup; poll the index for new versions while serving."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start = time.perf_counter()
        try:
            engine = loader(settings)
        except Exception as err:  # noqa: BLE001 - logged with its reason, then re-raised
            log.error("cannot start: %s: %s", type(err).__name__, err)
            raise
        app.state.engine = engine
        for warning in app.state.warnings:
            log.warning("%s", warning)
        poller = None
        if engine is not None:
            app.state.reloader = Reloader(engine, settings.index, on_swap=lambda: setattr(
                app, "openapi_schema", None))  # dims may change with the index
            if settings.reload_interval > 0:
                poller = asyncio.create_task(app.state.reloader.poll(settings.reload_interval))
        log.info("ready in %.1fs", time.perf_counter() - start)
        try:
            yield
        finally:
            if poller is not None:
                poller.cancel()
            app.state.engine = None

    return lifespan
