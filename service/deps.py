"""Dependencies: the settings, the loaded engine and the inference slots, as `Annotated`
aliases for routes. They are `async` so that resolving them never waits for a thread of the
pool that retrievals occupy (`/health` stays fast under load)."""

from __future__ import annotations

from typing import Annotated

from anyio import CapacityLimiter
from fastapi import Depends, HTTPException, Request

from service.retrieval import RetrievalEngine
from service.settings import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_engine(request: Request) -> RetrievalEngine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise HTTPException(status_code=503, detail="the model and index are not loaded yet")
    return engine


async def get_slots(request: Request) -> CapacityLimiter:
    """Threads that may decode and embed at once; waiting requests hold no thread."""
    return request.app.state.slots


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[RetrievalEngine, Depends(get_engine)]
SlotsDep = Annotated[CapacityLimiter, Depends(get_slots)]
