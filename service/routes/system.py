"""GET /health and GET /info."""

from __future__ import annotations

from fastapi import APIRouter, Request

from service.deps import EngineDep, SettingsDep
from service.policy import policy
from service.schemas import ERRORS, DimsRange, HealthOut, InfoOut, Limits

router = APIRouter(tags=["system"])


@router.get("/health", response_model=HealthOut, responses=ERRORS(503))
@policy(public=True)
async def health(engine: EngineDep) -> HealthOut:
    """200 once the model and index are loaded (503 before). Runs on the event loop, never
    in the thread pool that retrievals fill, so it answers at once under load."""
    return HealthOut(status="ok")


@router.get("/info", response_model=InfoOut, responses=ERRORS(503))
def info(engine: EngineDep, settings: SettingsDep, request: Request) -> InfoOut:
    gallery, version = engine.galleries.current()
    side = gallery.sidecar
    model = engine.model
    return InfoOut(
        model=str(model.path),
        model_sha256=model.sha256,
        backbone=model.backbone,
        encoder=engine.encoder.name,
        precision=engine.encoder.precision,
        sketch_flip_average=engine.sketch_flip_average,
        sketch_size=model.size_of("sketch"),
        gallery_smoothing=side.smoothing,
        hubness_correction=side.hubness,
        query_expansion=({**engine.expansion.as_dict(), "rescore": engine.expand_rescore}
                         if engine.expansion.active else {}),
        width=model.width,
        modes=model.modes,
        raw_dims=model.raw_dims,
        available_dims=DimsRange(min=1, max=gallery.dims),
        gallery_size=len(gallery),
        classes=sum(1 for c in gallery.photos.classes if c),
        index_kind=side.kind,
        index_version=version,
        metric=side.metric,
        limits=Limits(max_upload_bytes=settings.max_upload_bytes, max_pixels=settings.max_pixels,
                      max_k=settings.max_k, default_k=settings.default_k,
                      max_batch=settings.max_batch, max_pending=settings.max_pending),
        warnings=request.app.state.warnings,
    )
