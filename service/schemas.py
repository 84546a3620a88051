"""Response models: the JSON contract of the API."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HitOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    id: str
    class_: str = Field(alias="class")
    score: float
    url: str


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


class InfoOut(BaseModel):
    model: str
    checkpoint_sha256: str
    backbone: str
    L: int
    available_dims: DimsRange
    gallery_size: int
    classes: int
    index_kind: str
    metric: str
    limits: Limits
