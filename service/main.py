"""The FastAPI app: settings, lifespan loading, middleware, routers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from service.engine import RetrievalEngine, load_engine
from service.middleware import AccessLogMiddleware, BodyLimitMiddleware
from service.routes import photos, retrieve, system, web
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    loader: Callable[[Settings], RetrievalEngine] = load_engine,
) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start = time.perf_counter()
        try:
            app.state.engine = loader(settings)
        except Exception as err:  # noqa: BLE001 - logged with its reason, then re-raised
            log.error("cannot start: %s: %s", type(err).__name__, err)
            raise
        log.info("ready in %.1fs", time.perf_counter() - start)
        yield
        app.state.engine = None

    app = FastAPI(title="sketchsvd retrieval", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = None
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(AccessLogMiddleware)
    for router in (retrieve.router, photos.router, system.router, web.router):
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=web.STATIC_DIR), name="static")
    return app
