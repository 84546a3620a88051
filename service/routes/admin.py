"""Operations: POST /admin/reload (serve the index version CURRENT names now; an admin key when
any key is configured, service.auth) and GET /metrics (Prometheus text format; the API key
when keys are on)."""

from __future__ import annotations

from anyio import to_thread
from fastapi import APIRouter, HTTPException, Request, Response

from service.deps import EngineDep
from service.metrics import CONTENT_TYPE
from service.policy import policy
from service.schemas import ERRORS, ReloadOut

router = APIRouter(tags=["operations"])


@router.post("/admin/reload", response_model=ReloadOut, responses=ERRORS(401, 403, 409, 503))
@policy(admin=True)
async def reload(request: Request, engine: EngineDep) -> ReloadOut:
    """Check the index folder now (the service also polls it): a new version is opened,
    checked and served; 409 names the reason when it is refused (the old one keeps
    serving)."""
    outcome = await to_thread.run_sync(request.app.state.reloader.check, True)
    if outcome.refused is not None:
        raise HTTPException(409, f"index version not served: {outcome.refused}; still serving "
                                 f"version {outcome.served}")
    return ReloadOut(version=outcome.served, changed=outcome.changed)


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"},
    **ERRORS(401)})
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
