"""A small Python client of the retrieval service (needs httpx only).

    from service.client import Client

    with Client("http://127.0.0.1:8000", api_key=None) as service:
        result = service.retrieve("sketch.png", dims=16, k=10)  # a path, bytes or (name, bytes)
        for hit in result.hits:
            print(hit.id, hit.cls, round(hit.score, 3))
        jpeg = service.photo(result.hits[0])
        results = service.retrieve_batch(["a.png", "b.png"], k=5)  # one Result each

`AsyncClient` has the same methods, to be awaited. An answer other than 2xx raises
ServiceError with the status and the service's `detail`. A `Client` can also wrap an
existing httpx client (e.g. FastAPI's TestClient): `Client(http=test_client)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["AsyncClient", "Client", "Hit", "Result", "ServiceError"]

Sketch = bytes | str | Path | tuple[str, bytes]
MEDIA = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}


@dataclass(frozen=True)
class Hit:
    id: str
    cls: str
    score: float
    url: str  # relative to the service; signed (short-lived) when the service has keys


@dataclass(frozen=True)
class Result:
    """The top-k photos of one sketch, best first."""

    dims: int
    k: int
    hits: tuple[Hit, ...]
    filename: str | None = None  # batch results: the sketch's file name
    timings: dict[str, float] = field(default_factory=dict)  # server stages, ms (Server-Timing)

    @property
    def ids(self) -> list[str]:
        return [h.id for h in self.hits]


class ServiceError(Exception):
    def __init__(self, status: int, detail: str, retry_after: str | None = None):
        super().__init__(f"{status}: {detail}")
        self.status, self.detail, self.retry_after = status, detail, retry_after


def _file(sketch: Sketch, index: int = 0) -> tuple[str, bytes, str]:
    if isinstance(sketch, tuple):
        name, data = sketch
    elif isinstance(sketch, bytes):
        name, data = f"sketch{index}.png", sketch
    else:
        name, data = Path(sketch).name, Path(sketch).read_bytes()
    return name, data, MEDIA.get(Path(name).suffix.lower(), "application/octet-stream")


def _params(dims: int | None, k: int | None) -> dict[str, int]:
    return {n: v for n, v in (("dims", dims), ("k", k)) if v is not None}


def _checked(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        detail = response.text[:200]
    raise ServiceError(response.status_code, str(detail), response.headers.get("retry-after"))


def _timings(header: str | None) -> dict[str, float]:
    parts = (p.strip().partition(";dur=") for p in (header or "").split(",") if p.strip())
    return {name: float(ms) for name, _, ms in parts}


def _result(body: dict, response: httpx.Response, filename: str | None = None) -> Result:
    hits = tuple(Hit(h["id"], h["class"], float(h["score"]), h["url"])
                 for h in body["results"])
    return Result(body.get("dims", 0), body.get("k", 0), hits, filename,
                  _timings(response.headers.get("server-timing")))


def _batch(response: httpx.Response) -> list[Result]:
    body = response.json()
    return [_result({**q, "dims": body["dims"], "k": body["k"]}, response, q["filename"])
            for q in body["queries"]]


def _photo_path(photo: Hit | str) -> str:
    path = photo.url if isinstance(photo, Hit) else photo
    return path if path.startswith("/") else f"/photos/{path}"  # a URL, else an id


class Client:
    """Blocking client: `base_url` of the service, its API key if it has keys."""

    def __init__(self, base_url: str = "", api_key: str | None = None, timeout: float = 30.0,
                 http: httpx.Client | None = None):
        headers = {"X-API-Key": api_key} if api_key else {}
        self.http = http or httpx.Client(base_url=base_url, timeout=timeout)
        self._own = http is None
        self.headers = headers

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.http.close()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return _checked(self.http.request(method, path, headers=self.headers, **kw))

    def retrieve(self, sketch: Sketch, dims: int | None = None, k: int | None = None) -> Result:
        r = self._request("POST", "/retrieve", params=_params(dims, k),
                          files={"file": _file(sketch)})
        return _result(r.json(), r)

    def retrieve_batch(self, sketches: list[Sketch], dims: int | None = None,
                       k: int | None = None) -> list[Result]:
        files = [("files", _file(s, i)) for i, s in enumerate(sketches)]
        return _batch(self._request("POST", "/retrieve/batch", params=_params(dims, k),
                                    files=files))

    def photo(self, photo: Hit | str) -> bytes:
        """The photo file of a hit (its URL), or of a photo id."""
        return self._request("GET", _photo_path(photo)).content

    def info(self) -> dict:
        return self._request("GET", "/info").json()

    def health(self) -> bool:
        return self.http.get("/health").status_code == 200

    def reload(self) -> dict:
        """Serve the index version CURRENT names now ({"version", "changed"})."""
        return self._request("POST", "/admin/reload").json()

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text


class AsyncClient:
    """`Client`'s methods, awaited (for many requests in flight from one thread)."""

    def __init__(self, base_url: str = "", api_key: str | None = None, timeout: float = 30.0,
                 http: httpx.AsyncClient | None = None, connections: int = 16):
        limits = httpx.Limits(max_connections=connections,
                              max_keepalive_connections=connections)
        self.http = http or httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits)
        self._own = http is None
        self.headers = {"X-API-Key": api_key} if api_key else {}

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own:
            await self.http.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return _checked(await self.http.request(method, path, headers=self.headers, **kw))

    async def retrieve(self, sketch: Sketch, dims: int | None = None, k: int | None = None
                       ) -> Result:
        r = await self._request("POST", "/retrieve", params=_params(dims, k),
                                files={"file": _file(sketch)})
        return _result(r.json(), r)

    async def retrieve_batch(self, sketches: list[Sketch], dims: int | None = None,
                             k: int | None = None) -> list[Result]:
        files = [("files", _file(s, i)) for i, s in enumerate(sketches)]
        return _batch(await self._request("POST", "/retrieve/batch",
                                          params=_params(dims, k), files=files))

    async def photo(self, photo: Hit | str) -> bytes:
        return (await self._request("GET", _photo_path(photo))).content

    async def info(self) -> dict:
        return (await self._request("GET", "/info")).json()

    async def health(self) -> bool:
        return (await self.http.get("/health")).status_code == 200

    async def reload(self) -> dict:
        return (await self._request("POST", "/admin/reload")).json()

    async def metrics(self) -> str:
        return (await self._request("GET", "/metrics")).text
