"""API keys: off by default; when on, 401 in the one error shape on every route but /health
and the page, keys from the environment or a file, signed photo URLs for <img>, and a
comparison that takes the same time for any wrong key."""

import statistics
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from service.auth import UNAUTHORIZED, Keys, read_keys
from service.client import Client, ServiceError
from service.main import create_app
from service.settings import Settings
from tests.service.conftest import serve, sketch_png

KEY = "k3y-0123456789abcdef0123456789abcdef"


@pytest.fixture
def keyed_settings(settings):
    return settings.model_copy(update={"api_keys": [KEY, "second-key"]})


@pytest.fixture
def keyed(keyed_settings, engine):
    with TestClient(create_app(keyed_settings, loader=lambda s: engine)) as client:
        yield client


def every_path(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    from fastapi.routing import iter_route_contexts

    out = []
    for route in iter_route_contexts(list(app.routes)):
        path = route.path.replace("{photo_id}", "c0_0_000")
        for method in sorted(route.methods or {"GET"}):
            out.append((method, path if path != "/static" else "/static/app.js"))
    return out


def test_keys_are_off_by_default(client):
    assert client.get("/info").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_without_a_key_every_route_is_401_but_health_and_the_page(keyed):
    opened = {"/health", "/", "/static/app.js"}
    paths = every_path(keyed.app)
    assert {"/retrieve", "/retrieve/batch", "/metrics", "/admin/reload", "/info",
            "/photos/c0_0_000", "/openapi.json", "/docs"} <= {p for _, p in paths}
    for method, path in paths:
        for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = keyed.request(method, path, headers=headers)
            if path in opened:
                assert r.status_code == 200, (method, path)
            else:
                assert r.status_code == 401, (method, path, headers)
                assert method == "HEAD" or r.json() == {"detail": UNAUTHORIZED}
    assert keyed.post("/no/such/route").status_code == 401  # no hint of what exists


def test_a_valid_key_opens_every_route(keyed):
    for headers in ({"X-API-Key": KEY}, {"X-API-Key": "second-key"},
                    {"Authorization": f"Bearer {KEY}"}):
        assert keyed.get("/info", headers=headers).status_code == 200
        assert keyed.get("/metrics", headers=headers).status_code == 200
    with Client(http=keyed, api_key=KEY) as service:
        assert service.retrieve(sketch_png(), k=2).hits
    with Client(http=keyed, api_key="wrong") as service, pytest.raises(ServiceError) as err:
        service.retrieve(sketch_png(), k=2)
    assert err.value.status == 401


def test_results_link_photos_with_urls_that_open_without_a_key(keyed, engine):
    with Client(http=keyed, api_key=KEY) as service:
        hit = service.retrieve(sketch_png(), k=1).hits[0]
    assert hit.url.startswith(f"/photos/{hit.id}?expires=")
    photo = keyed.get(hit.url)  # as an <img src>: no header
    assert photo.status_code == 200 and photo.content == engine.read_photo(hit.id)[0]
    assert keyed.get(f"/photos/{hit.id}").status_code == 401
    assert keyed.get(hit.url[:-1] + ("0" if hit.url[-1] != "0" else "1")).status_code == 401
    other = engine.gallery.photos[1].id
    assert keyed.get(hit.url.replace(hit.id, other)).status_code == 401  # not another photo


def test_signed_urls_expire():
    now = [1_000_000.0]
    keys = Keys([KEY], url_ttl=60, clock=lambda: now[0])
    url = keys.sign("/photos/a")
    path, _, query = url.partition("?")
    assert keys.signed(path, query)
    now[0] += 60
    assert keys.signed(path, query)
    now[0] += 1
    assert not keys.signed(path, query)
    assert not Keys(["another"], url_ttl=60, clock=lambda: 0).signed(path, query)
    assert not keys.signed(path, "expires=9999999999&sig=00")
    assert not keys.signed(path, "sig=abc")


def test_keys_from_the_environment_and_a_file(tmp_path, monkeypatch, fake_index):
    monkeypatch.setenv("SKETCHSVD_API_KEYS", '["from-env"]')
    (tmp_path / "keys").write_text("# rotated monthly\nfrom-file\n\n  other  \n")
    settings = Settings(index=fake_index[0], api_keys_file=tmp_path / "keys")
    assert read_keys(settings) == ["from-env", "from-file", "other"]
    (tmp_path / "empty").write_text("# none yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_keys(Settings(index=fake_index[0], api_keys_file=tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read the API key file"):
        read_keys(Settings(index=fake_index[0], api_keys_file=tmp_path / "missing"))


def min_time(fn, arg, rounds: int = 2000) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        fn(arg)
        best = min(best, time.perf_counter_ns() - t0)
    return best


def test_a_wrong_key_takes_as_long_whatever_its_length_or_its_likeness():
    keys = Keys([KEY, "x" * 64, "y" * 7])
    wrong = {"right length": "z" * len(KEY), "one character off": KEY[:-1] + "!",
             "short": "k", "long": "k" * 4096 + KEY}
    times = {name: min_time(keys.valid, key) for name, key in wrong.items()}
    times["none"] = min_time(keys.valid, None)
    base = times["right length"]
    for name, t in times.items():
        if name != "long":  # hashing 4 KiB costs its own few microseconds
            assert 0.7 < t / base < 1.4, times
    assert not any(keys.valid(k) for k in wrong.values()) and keys.valid(KEY)


def test_over_http_a_wrong_key_of_the_right_length_takes_as_long_as_another(keyed_settings,
                                                                            engine):
    app = create_app(keyed_settings, loader=lambda s: engine)
    keys = {"right length": "z" * len(KEY), "short": "k"}
    times = {name: [] for name in keys}
    with serve(app, keyed_settings) as url, httpx.Client(base_url=url) as http:
        for _ in range(150):  # interleaved, so load changes touch both alike
            for name, key in keys.items():
                t0 = time.perf_counter()
                assert http.get("/info", headers={"X-API-Key": key}).status_code == 401
                times[name].append(time.perf_counter() - t0)
        assert http.get("/info", headers={"X-API-Key": KEY}).status_code == 200
    medians = {n: statistics.median(t) for n, t in times.items()}
    ratio = medians["right length"] / medians["short"]
    print(f"401 medians: {medians}, ratio {ratio:.3f}")
    assert 0.8 < ratio < 1.25, medians
