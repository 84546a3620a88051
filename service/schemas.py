"""Response models: the JSON contract of the API."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HitOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    id: str
    class_: str | None = Field(alias="class", description="the photo's class folder; null "
                               "for a photo without one")
    score: float
    url: str
    path: str = Field(description="the photo's path in its gallery folder (for display)")


class RetrieveOut(BaseModel):
    dims: int
    k: int
    results: list[HitOut]


class QueryOut(BaseModel):
    filename: str
    results: list[HitOut]


class BatchOut(BaseModel):
    dims: int
    k: int
    queries: list[QueryOut]


class ErrorOut(BaseModel):
    """The body of every 4xx and 5xx answer."""

    detail: str = Field(description="what was wrong, naming the value or file")


ERROR_MEANING = {
    400: "empty, truncated or damaged image",
    401: "API keys are on and the request has no valid key (or signed URL)",
    403: "an API key on an admin route, or a POST from another site's page (keys off)",
    404: "unknown photo id",
    408: "request body too slow",
    409: "the new index version is refused (the reason is named; the old one serves on)",
    413: "body, file, pixel count, batch or multipart parts over its limit",
    415: "not a PNG/JPEG/WebP image",
    422: "a parameter or field is missing or out of range",
    429: "too many uploads in progress from this client address (see Retry-After)",
    503: "not loaded yet, busy or shutting down (see Retry-After)",
}


def ERRORS(*codes: int) -> dict[int | str, dict]:  # noqa: N802 - reads as a constant table
    """OpenAPI `responses` for the error codes a route can answer, all shaped `ErrorOut`."""
    return {code: {"model": ErrorOut, "description": ERROR_MEANING[code]} for code in codes}


class HealthOut(BaseModel):
    status: str = "ok"


class DimsRange(BaseModel):
    min: int
    max: int


class Limits(BaseModel):
    max_upload_bytes: int
    max_pixels: int
    max_k: int
    default_k: int
    max_batch: int
    max_pending: int


class InfoOut(BaseModel):
    model: str  # the model bundle's folder
    model_sha256: str  # its identity (the sha256 of its model.json)
    backbone: str
    encoder: str  # what embeds query sketches: onnxruntime or torch
    precision: str  # its arithmetic: fp32 or int8
    sketch_flip_average: bool  # each sketch averaged with its mirror image (two backbone passes)
    sketch_size: int  # the side (px) query sketches are resized to before the encoder
    gallery_smoothing: dict  # the index's smoothing of photos ({k, weight, rounds}; {}: none)
    # the hubness correction the index stores ({k, weight}; {}: none); full-width queries only
    hubness_correction: dict
    # each query expanded with its best photos ({n, weight, rescore}; {}: none)
    query_expansion: dict
    width: int  # the embeddings' width: the learned modes, then the raw coordinates
    modes: int  # the learned singular functions: dims <= modes queries use them alone
    raw_dims: int  # centred backbone-feature coordinates after the modes (0: none)
    available_dims: DimsRange
    gallery_size: int
    classes: int
    index_kind: str
    index_version: str | None  # the version folder served (None: an index without versions)
    metric: str
    limits: Limits
    # what the operator should know, e.g. listening beyond loopback without API keys
    warnings: list[str] = []


class ReloadOut(BaseModel):
    version: str | None  # the index version served now
    changed: bool  # whether this check switched to it
