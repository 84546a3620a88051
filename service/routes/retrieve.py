"""POST /retrieve and POST /retrieve/batch: sketches in, ranked gallery photos out."""

from __future__ import annotations

from typing import Annotated, BinaryIO

from anyio import to_thread
from fastapi import APIRouter, File, HTTPException, Query, Response, UploadFile

from service.auth import Keys
from service.deps import Retrieval, RetrievalDep
from service.policy import policy
from service.retrieval import DimsError, Hit, RetrievalEngine
from service.schemas import ERRORS, BatchOut, HitOut, QueryOut, RetrieveOut
from service.settings import Settings
from training.images import (
    EmptyImageError,
    ImageError,
    ImageTooLargeError,
    NotAnImageError,
    TruncatedImageError,
    check_size,
)

router = APIRouter(tags=["retrieve"])

STATUS = {
    EmptyImageError: 400,
    TruncatedImageError: 400,
    NotAnImageError: 415,
    ImageTooLargeError: 413,
}

# Static bounds here; the upper ones depend on the index (dims, checked by the engine) and
# on the settings (k <= max_k, checked in resolve_params); main.openapi writes both into the
# schema.
DimsParam = Annotated[int | None, Query(ge=1, description="modes used for scoring, 1..stored "
                                                          "dims (default: all stored)")]
KParam = Annotated[int | None, Query(ge=1, description="number of photos returned, 1..max_k")]


def http_error(err: ImageError | DimsError) -> HTTPException:
    if isinstance(err, DimsError):
        return HTTPException(status_code=422, detail=str(err))
    return HTTPException(status_code=STATUS.get(type(err), 400), detail=str(err))


def resolve_params(engine: RetrievalEngine, settings: Settings, dims: int | None,
                   k: int | None) -> tuple[int, int]:
    """Defaults for omitted parameters, and the settings' bound on k."""
    dims = engine.dims if dims is None else dims
    k = settings.default_k if k is None else k
    if k > settings.max_k:
        raise HTTPException(422, f"k={k} is outside [1, {settings.max_k}]")
    return dims, k


RETRIEVE_ERRORS = ERRORS(400, 401, 403, 408, 413, 415, 422, 429, 503)


def upload_of(file: UploadFile, limit: int) -> tuple[str, BinaryIO]:
    """(name, file) of an upload within `limit` bytes; the bytes are read later, in a slot."""
    name = file.filename or "file"
    try:
        check_size(file.size if file.size is not None else 0, limit, name)
    except ImageTooLargeError as err:
        raise http_error(err) from err
    return name, file.file


def hits_out(hits: list[Hit], keys: Keys) -> list[HitOut]:
    """Hits with their photo URLs (signed when keys are on, so that <img src> opens them)."""
    url = keys.sign if keys.enabled else (lambda path: path)
    return [HitOut(id=h.id, class_=h.cls or None, score=h.score, url=url(f"/photos/{h.id}"),
                   path=h.path)
            for h in hits]


async def run_retrieval(ctx: Retrieval, uploads, dims: int, k: int, response: Response
                        ) -> list[list[Hit]]:
    try:
        # Waiting for a slot happens here, on the event loop, not in a pool thread.
        hits, timings = await to_thread.run_sync(ctx.engine.retrieve, uploads, dims, k,
                                                 limiter=ctx.slots)
    except (ImageError, DimsError) as err:
        raise http_error(err) from err
    response.headers["Server-Timing"] = timings.header()
    ctx.metrics.observe_stages(timings)
    return hits


@router.post("/retrieve", response_model=RetrieveOut, response_model_by_alias=True,
             responses=RETRIEVE_ERRORS)
@policy(body=lambda s: s.max_file_body_bytes, files=lambda s: 1, admitted=True)
async def retrieve(
    file: Annotated[UploadFile, File(description="the sketch, PNG/JPEG/WebP")],
    ctx: RetrievalDep,
    response: Response,
    dims: DimsParam = None,
    k: KParam = None,
) -> RetrieveOut:
    """Top-k gallery photos for one sketch, sorted by score (descending)."""
    dims, k = resolve_params(ctx.engine, ctx.settings, dims, k)
    upload = upload_of(file, ctx.settings.max_upload_bytes)
    hits = await run_retrieval(ctx, [upload], dims, k, response)
    return RetrieveOut(dims=dims, k=k, results=hits_out(hits[0], ctx.keys))


@router.post("/retrieve/batch", response_model=BatchOut, response_model_by_alias=True,
             responses=RETRIEVE_ERRORS)
@policy(body=lambda s: s.max_body_bytes, files=lambda s: s.max_batch, admitted=True)
async def retrieve_batch(
    files: Annotated[list[UploadFile], File(description="several sketches")],
    ctx: RetrievalDep,
    response: Response,
    dims: DimsParam = None,
    k: KParam = None,
) -> BatchOut:
    """Top-k photos for each of several sketches, embedded as one batch."""
    dims, k = resolve_params(ctx.engine, ctx.settings, dims, k)
    if len(files) > ctx.settings.max_batch:
        raise HTTPException(413, f"{len(files)} files is over the batch limit of "
                                 f"{ctx.settings.max_batch}")
    uploads = [upload_of(f, ctx.settings.max_upload_bytes) for f in files]
    hits = await run_retrieval(ctx, uploads, dims, k, response)
    return BatchOut(dims=dims, k=k, queries=[
        QueryOut(filename=name, results=hits_out(h, ctx.keys))
        for (name, _), h in zip(uploads, hits, strict=True)
    ])
