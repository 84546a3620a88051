"""All service settings in one place; environment variables `SKETCHSVD_*` override defaults
and `python -m service` has one dashed flag per field (`--photos-dir`), which overrides
both."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers around the files
SMALL_BODY_BYTES = 64 * 1024  # any route that declares no other limit (service.policy)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKETCHSVD_", frozen=True, extra="forbid")

    index: Path = Path("runs/index")
    model: Path | None = Field(
        default=None, description="the model bundle folder (training.cdk writes it); None: "
        "the one the index was built with (its sidecar names it)")
    # Override it when the photos moved, e.g. into a container volume.
    photos_dir: Path | None = Field(
        default=None, description="None: the photo folder recorded in the index sidecar")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    device: str | None = Field(default=None, description="None: CUDA when present, else CPU")
    encoder: Literal["auto", "onnx", "torch"] = Field(
        default="auto", description="sketch encoder. auto: the bundle's ONNX graph on ONNX "
        "Runtime on the CPU, its PyTorch modules on CUDA")
    precision: Literal["auto", "fp32", "int8"] = Field(
        default="auto", description="the ONNX sketch encoder's arithmetic. auto: the bundle's "
        "choice (int8 where it held parity with float32 on the model's validation classes and "
        "was faster when the bundle was written), else the one named")
    expand_n: int | None = Field(
        default=None, ge=0, description="query expansion: each query moves toward the mean "
        "of its expand_n best photos and ranks again (expand_rescore); None: the "
        "model's (the cpu preset: 5); 0: off (one search)")
    expand_rescore: int = Field(  # training.cdk.model.smoothing.RESCORE (torch-free here)
        default=10, ge=0, description="the expanded query re-scores a pool of at least "
        "max(100, expand_rescore x k) candidates (the index kind's) instead of searching the "
        "whole index again (the same top 10 where measured); 0: a second full search")
    # training.cdk's name: whether a sketch is averaged with its mirror image
    sketch_flip_average: bool | None = Field(
        default=None, description="None: sketches embedded as the model was trained "
        "(the cpu preset embeds each sketch alone, one backbone pass; a model trained "
        "with --sketch-flip-average averages it with its mirror image: two passes); "
        "false: the sketch alone even then (x1.6 queries/s on the CPU)")
    threads: int = Field(default=1, ge=1, description="torch/FAISS threads per inference")
    inference_slots: int = Field(default=2, ge=1, description="retrievals computing at once "
                                 "(decode, forward, search); more wait for a slot")
    embed_batch: int = Field(default=4, ge=1, description="sketches per forward; bounds the "
                             "activation memory of a batch request (raise it on a GPU)")
    max_pending: int = Field(
        default=32, ge=1, description="retrieval requests admitted at once (running or waiting "
        "for a slot); a request counts once its body is in, and more are answered 503 with "
        "Retry-After")
    header_timeout: float = Field(default=10.0, gt=0,
                                  description="seconds to receive a request's headers")
    body_timeout: float = Field(
        default=10.0, gt=0, description="seconds a request's body may take before it must "
        "keep up body_min_rate: a body of n bytes has body_timeout + n / body_min_rate "
        "seconds, and is 408 when it falls behind")
    keep_alive_timeout: int = Field(default=5, ge=1,
                                    description="seconds an idle connection stays open")

    reload_interval: float = Field(
        default=1.0, ge=0, description="seconds between reads of the index's CURRENT pointer; "
        "a new version is served without a restart (0: only on POST /admin/reload)")
    shutdown_timeout: float = Field(
        default=20.0, gt=0, description="seconds admitted requests get to finish after "
        "SIGTERM, while new ones are answered 503")
    api_keys: list[str] = Field(
        default=[], description="API keys (SKETCHSVD_API_KEYS as a JSON list; prefer the "
        "environment or a file to a flag, which other users can see). Any key: every route "
        "but /health and the page needs one")
    api_keys_file: Path | None = Field(
        default=None, description="a file of API keys, one a line (# comments)")
    signed_url_ttl: int = Field(
        default=300, ge=1, description="seconds a signed photo URL in a result stays valid "
        "(keys on)")

    # The edge against hostile clients (docs/service.md, Security).
    body_min_rate: int = Field(
        default=4096, ge=1, description="bytes/s a request body must average once "
        "body_timeout is spent")
    max_uploads_per_client: int = Field(
        default=32, ge=1, description="requests from one client address whose body is still "
        "arriving; more are answered 429 before their body is read")
    max_connections: int = Field(
        default=512, ge=2, description="open connections; a request that finds them all "
        "open is answered 503 (uvicorn's limit_concurrency)")
    admin_keys: list[str] = Field(
        default=[], description="keys for /admin/* (SKETCHSVD_ADMIN_KEYS as a JSON list). An "
        "admin key opens every route, an API key every route but /admin/*, which is closed "
        "when there are API keys and no admin key")
    admin_keys_file: Path | None = Field(
        default=None, description="a file of admin keys, one a line (# comments)")
    allowed_hosts: list[str] | None = Field(
        default=None, description="the names the service answers to in the Host header "
        "('*': any, '*.example.org': its subdomains); None: a request that arrives on a "
        "loopback address must name a loopback host (DNS rebinding), others any")

    max_upload_bytes: int = Field(default=5 * 1024 * 1024, ge=1)
    max_pixels: int = Field(default=4096 * 4096, ge=1, description="width x height of an upload")
    max_k: int = Field(default=100, ge=1)
    default_k: int = Field(default=12, ge=1)
    max_batch: int = Field(default=16, ge=1)
    cors_origins: list[str] = []
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @property
    def max_body_bytes(self) -> int:
        """Largest request body: a full batch of maximal files plus multipart overhead."""
        return self.max_upload_bytes * self.max_batch + MULTIPART_OVERHEAD

    @property
    def max_file_body_bytes(self) -> int:
        """Largest body of one file: the file plus multipart overhead."""
        return self.max_upload_bytes + MULTIPART_OVERHEAD
