"""Dependencies: the settings, the loaded engine and what a retrieval needs, as `Annotated`
aliases for routes. They are `async` so that resolving them never waits for a thread of the
pool that retrievals occupy (`/health` stays fast under load)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from anyio import CapacityLimiter
from fastapi import Depends, HTTPException, Request

from service.auth import Keys
from service.metrics import Metrics
from service.retrieval import RetrievalEngine
from service.settings import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_engine(request: Request) -> RetrievalEngine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise HTTPException(status_code=503, detail="the model and index are not loaded yet")
    return engine


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[RetrievalEngine, Depends(get_engine)]


@dataclass(frozen=True)
class Retrieval:
    """What a retrieval route uses: the engine, the settings, the inference slots (threads
    that may decode, embed and search at once; waiting requests hold no thread), the API
    keys (to sign photo URLs) and the metrics (to observe the stages)."""

    engine: RetrievalEngine
    settings: Settings
    slots: CapacityLimiter
    keys: Keys
    metrics: Metrics


async def get_retrieval(request: Request, engine: EngineDep) -> Retrieval:
    state = request.app.state
    return Retrieval(engine, state.settings, state.slots, state.keys, state.metrics)


RetrievalDep = Annotated[Retrieval, Depends(get_retrieval)]
