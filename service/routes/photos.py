"""GET /photos/{id}: serve a gallery photo; only ids in the index table resolve to files, and
only files below the photo root are read (service.photo_files)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response

from service.deps import EngineDep
from service.photo_files import UnknownPhotoError
from service.policy import policy
from service.schemas import ERRORS

router = APIRouter(tags=["photos"])


@router.get("/photos/{photo_id}", name="photo", response_class=Response,
            responses={200: {"content": {"image/*": {}}, "description": "the photo file"},
                       **ERRORS(401, 404, 503)})
@policy(signed=True)  # results link here with a signed URL when keys are on (service.auth)
def photo(photo_id: str, engine: EngineDep, request: Request) -> Response:
    try:
        data, media_type = engine.read_photo(photo_id)
    except UnknownPhotoError as err:
        raise HTTPException(status_code=404, detail=err.args[0]) from err
    # With keys, a shared cache (a proxy, a CDN) must not hand a photo to whoever asks.
    cache = "private" if request.app.state.keys.enabled else "public"
    return Response(data, media_type=media_type,
                    headers={"Cache-Control": f"{cache}, max-age=86400"})
