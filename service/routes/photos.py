"""GET /photos/{id}: serve a gallery photo; only ids in the index table resolve to files."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

from service.deps import EngineDep
from service.engine import UnknownPhotoError
from service.schemas import ERRORS

router = APIRouter(tags=["photos"])


@router.get("/photos/{photo_id}", name="photo", response_class=FileResponse,
            responses={200: {"content": {"image/*": {}}, "description": "the photo file"},
                       **ERRORS(404, 503)})
def photo(photo_id: str, engine: EngineDep) -> FileResponse:
    try:
        path = engine.photo_file(photo_id)
    except UnknownPhotoError as err:
        raise HTTPException(status_code=404, detail=err.args[0]) from err
    return FileResponse(path, headers={"Cache-Control": "public, max-age=86400"})
