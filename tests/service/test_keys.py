"""API keys: off by default; when on, 401 in the one error shape on every route but /health
and the page, keys from the environment or a file, signed photo URLs for <img>, and a
comparison that takes the same time for any wrong key. Admin keys of their own for /admin/*;
an empty key refuses the start; photos kept out of shared caches when keys are on."""

import statistics
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from service.auth import (
    ADMIN_ONLY,
    ADMIN_UNAUTHORIZED,
    NO_ADMIN_KEY,
    UNAUTHORIZED,
    Keys,
    key_id,
    read_keys,
)
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
                detail = ADMIN_UNAUTHORIZED if path.startswith("/admin/") else UNAUTHORIZED
                assert method == "HEAD" or r.json() == {"detail": detail}
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


def min_times(fn, args: dict, rounds: int = 2000) -> dict[str, float]:
    """The fastest of `rounds` calls fn(arg) for each of `args` ({name: arg}), in
    nanoseconds, the calls interleaved so that a change in the machine's load touches
    every argument alike."""
    best = dict.fromkeys(args, float("inf"))
    for _ in range(rounds):
        for name, arg in args.items():
            t0 = time.perf_counter_ns()
            fn(arg)
            best[name] = min(best[name], time.perf_counter_ns() - t0)
    return best


def test_a_wrong_key_takes_as_long_whatever_its_length_or_its_likeness():
    keys = Keys([KEY, "x" * 64, "y" * 7])
    wrong = {"right length": "z" * len(KEY), "one character off": KEY[:-1] + "!",
             "short": "k", "long": "k" * 4096 + KEY}
    times = min_times(keys.valid, {**wrong, "none": None})
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


ADMIN = "adm1n-0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("keys", [[""], ["   "], [KEY, ""], ["\t\n"]])
def test_an_empty_or_blank_key_refuses_to_start(settings, engine, keys):
    """'["${API_KEY}"]' with the variable unset gives [""]: that service would be open."""
    with pytest.raises(ValueError, match=r"api_keys \(SKETCHSVD_API_KEYS\) holds an empty key"):
        create_app(settings.model_copy(update={"api_keys": keys}), loader=lambda s: engine)
    with pytest.raises(ValueError, match=r"admin_keys \(SKETCHSVD_ADMIN_KEYS\) holds an empty"):
        create_app(settings.model_copy(update={"admin_keys": keys}), loader=lambda s: engine)
    with pytest.raises(ValueError, match="spaces around it"):
        create_app(settings.model_copy(update={"api_keys": [f" {KEY}"]}),
                   loader=lambda s: engine)


def test_python_m_service_with_an_empty_key_exits_naming_the_setting(fake_index, monkeypatch,
                                                                      capsys):
    from service.__main__ import main

    monkeypatch.setenv("SKETCHSVD_API_KEYS", '[""]')
    assert main(["--index", str(fake_index[0])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: api_keys (SKETCHSVD_API_KEYS) holds an empty key"), err


@pytest.fixture
def admin_settings(keyed_settings):
    return keyed_settings.model_copy(update={"admin_keys": [ADMIN]})


def test_admin_routes_need_an_admin_key(admin_settings, engine):
    with TestClient(create_app(admin_settings, loader=lambda s: engine)) as http:
        def reload(key=None):
            return http.post("/admin/reload", headers={"X-API-Key": key} if key else {})

        assert reload(ADMIN).status_code == 200
        for key in (KEY, "second-key"):  # API keys open everything else, not this
            r = reload(key)
            assert (r.status_code, r.json()) == (403, {"detail": ADMIN_ONLY})
            assert http.get("/info", headers={"X-API-Key": key}).status_code == 200
        for key in (None, "wrong"):
            r = reload(key)
            assert (r.status_code, r.json()) == (401, {"detail": ADMIN_UNAUTHORIZED})
        for path in ("/info", "/metrics"):  # an admin key opens every route
            assert http.get(path, headers={"X-API-Key": ADMIN}).status_code == 200
        with Client(http=http, api_key=ADMIN) as service:
            assert service.retrieve(sketch_png(), k=2).hits


def test_with_api_keys_and_no_admin_key_admin_routes_are_closed(keyed):
    r = keyed.post("/admin/reload", headers={"X-API-Key": KEY})
    assert (r.status_code, r.json()) == (403, {"detail": NO_ADMIN_KEY})


def test_admin_keys_alone_close_admin_routes_only(settings, engine):
    only_admin = settings.model_copy(update={"admin_keys": [ADMIN]})
    with TestClient(create_app(only_admin, loader=lambda s: engine)) as http:
        assert http.get("/info").status_code == 200
        assert http.post("/admin/reload").status_code == 401
        assert http.post("/admin/reload", headers={"X-API-Key": ADMIN}).status_code == 200
        hit = Client(http=http).retrieve(sketch_png(), k=1).hits[0]
        assert hit.url == f"/photos/{hit.id}"  # no signing without API keys


def test_an_admin_key_may_not_also_be_an_api_key(keyed_settings, engine):
    shared = keyed_settings.model_copy(update={"admin_keys": [KEY]})
    with pytest.raises(ValueError, match=f"also API keys \\(id {key_id(KEY)}\\)"):
        create_app(shared, loader=lambda s: engine)


def test_photos_are_kept_out_of_shared_caches_when_keys_are_on(keyed, client):
    with Client(http=keyed, api_key=KEY) as service:
        url = service.retrieve(sketch_png(), k=1).hits[0].url
    assert keyed.get(url).headers["cache-control"] == "private, max-age=86400"
    with Client(http=client) as service:  # keys off: any cache may keep them
        url = service.retrieve(sketch_png(), k=1).hits[0].url
    assert client.get(url).headers["cache-control"] == "public, max-age=86400"
