"""service.client against the app (TestClient) and a real server: typed results equal to the
JSON the routes answer, the batch form, photos, errors as ServiceError."""

import asyncio

import numpy as np
import pytest

from service.client import AsyncClient, Client, Hit, Result, ServiceError
from tests.service.conftest import sketch_png


@pytest.fixture
def service(client):
    return Client(http=client)


def test_retrieve_gives_typed_hits_as_the_route_answers(service, client):
    png = sketch_png(seed=3)
    result = service.retrieve(png, dims=4, k=6)
    body = client.post("/retrieve", params={"dims": 4, "k": 6},
                       files={"file": ("q.png", png, "image/png")}).json()
    assert isinstance(result, Result) and (result.dims, result.k) == (4, 6)
    assert [(h.id, h.cls, h.url) for h in result.hits] == [
        (h["id"], h["class"], h["url"]) for h in body["results"]]
    np.testing.assert_allclose([h.score for h in result.hits],
                               [h["score"] for h in body["results"]], rtol=1e-6)
    assert set(result.timings) == {"decode", "preprocess", "encode", "search"}
    assert result.ids == [h.id for h in result.hits]


def test_batch_gives_one_result_per_sketch_in_order(service, tmp_path):
    pngs = [sketch_png(seed=s) for s in range(3)]
    (tmp_path / "third.png").write_bytes(pngs[2])
    results = service.retrieve_batch([pngs[0], ("second.png", pngs[1]), tmp_path / "third.png"],
                                     dims=5, k=4)
    assert [r.filename for r in results] == ["sketch0.png", "second.png", "third.png"]
    for png, result in zip(pngs, results, strict=True):
        assert result.ids == service.retrieve(png, dims=5, k=4).ids
        assert (result.dims, result.k, len(result.hits)) == (5, 4, 4)


def test_photo_by_hit_or_id(service, engine):
    hit = service.retrieve(sketch_png(), k=1).hits[0]
    assert isinstance(hit, Hit)
    data = service.photo(hit)
    assert data == service.photo(hit.id) == engine.read_photo(hit.id)[0]


def test_errors_raise_with_status_and_detail(service):
    with pytest.raises(ServiceError) as err:
        service.retrieve(b"not an image")
    assert err.value.status == 415 and "is not a PNG/JPEG/WEBP image" in err.value.detail
    with pytest.raises(ServiceError) as err:
        service.retrieve(sketch_png(), dims=99)
    assert err.value.status == 422 and err.value.detail == "dims=99 is outside [1, 8]"
    with pytest.raises(ServiceError) as err:
        service.photo("no_such_photo")
    assert err.value.status == 404


def test_info_health_and_the_async_client_over_http(live_server, small_sketches):
    with Client(live_server) as service:
        assert service.health()
        assert service.info()["width"] == 8
        want = service.retrieve(small_sketches[0], dims=8, k=5)

    async def concurrently():
        async with AsyncClient(live_server, connections=4) as service:
            return await asyncio.gather(*(service.retrieve(small_sketches[0], dims=8, k=5)
                                          for _ in range(4)))

    results = asyncio.run(concurrently())
    assert [r.ids for r in results] == [want.ids] * 4
