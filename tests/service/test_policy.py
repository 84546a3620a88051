"""A route declares its own edge policy (body limit, admission, open without a key) on its
endpoint; adding a route touches its router alone."""

import pytest
from fastapi import APIRouter, Request
from fastapi.testclient import TestClient

from service.main import create_app
from service.policy import RouteTable, policy
from service.settings import SMALL_BODY_BYTES, Settings


def extra_router() -> APIRouter:
    router = APIRouter()

    @router.post("/echo/{name}")
    @policy(body=lambda s: 100 + s.max_k, admitted=True)
    async def echo(name: str, request: Request) -> dict:
        return {"name": name, "bytes": len(await request.body())}

    @router.post("/plain")
    async def plain(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return router


@pytest.fixture
def app(settings, engine):
    app = create_app(settings, loader=lambda s: engine)
    app.include_router(extra_router())  # after create_app: nothing else is told
    return app


def test_a_new_route_gets_the_limit_it_declares(app, settings):
    limit = 100 + settings.max_k
    with TestClient(app) as client:
        ok = client.post("/echo/a", content=b"x" * limit)
        assert ok.status_code == 200 and ok.json() == {"name": "a", "bytes": limit}
        over = client.post("/echo/a", content=b"x" * (limit + 1))
        assert over.status_code == 413
        assert over.json()["detail"] == (f"request body of {limit + 1} bytes is over the "
                                          f"limit of {limit}")

        def stream():  # no Content-Length: counted while it arrives
            yield b"x" * limit
            yield b"x"

        streamed = client.post("/echo/b", content=stream())
        assert streamed.status_code == 413 and "over the limit" in streamed.json()["detail"]


def test_a_new_route_is_admitted_as_it_declares(app):
    admission = app.state.admission
    with TestClient(app) as client:
        assert client.post("/echo/a", content=b"x").status_code == 200
        assert client.post("/plain", content=b"x").status_code == 200
        assert (admission.admitted, admission.active) == (1, 0)  # /plain is not counted
        admission.active = admission.limit  # as if max_pending retrievals were running
        busy = client.post("/echo/a", content=b"x")
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert client.post("/plain", content=b"x").status_code == 200
        admission.active = 0
    assert admission.rejected == 1


def test_a_route_without_a_policy_gets_the_small_default(app):
    with TestClient(app) as client:
        assert client.post("/plain", content=b"x" * SMALL_BODY_BYTES).status_code == 200
        assert client.post("/plain", content=b"x" * (SMALL_BODY_BYTES + 1)).status_code == 413


def test_the_table_reads_the_service_routes(app, settings):
    table = RouteTable(lambda: app.routes, settings)

    def rule(path, method="GET"):
        return table.rule({"path": path, "method": method})

    assert rule("/retrieve", "POST").body == settings.max_file_body_bytes
    assert rule("/retrieve/batch", "POST").body == settings.max_body_bytes
    assert rule("/retrieve", "POST").admitted and not rule("/photos/x").admitted
    assert rule("/photos/x").name == "/photos/{photo_id}"
    assert rule("/health").public and rule("/").public and rule("/static/app.js").public
    assert not rule("/info").public and not rule("/retrieve", "POST").public
    assert rule("/no/such/path").name == "unmatched"
    assert not rule("/no/such/path").public


def test_policies_depend_on_the_settings(engine, fake_index):
    small = Settings(index=fake_index[0], max_upload_bytes=1000, max_batch=2)
    table = RouteTable(lambda: create_app(small, loader=lambda s: engine).routes, small)
    assert table.rule({"path": "/retrieve", "method": "POST"}).body == 1000 + 64 * 1024
    assert table.rule({"path": "/retrieve/batch", "method": "POST"}).body == 2000 + 64 * 1024
