"""Dependencies: the settings and the loaded engine, as `Annotated` aliases for routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from service.engine import RetrievalEngine
from service.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> RetrievalEngine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise HTTPException(status_code=503, detail="the model and index are not loaded yet")
    return engine


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[RetrievalEngine, Depends(get_engine)]
