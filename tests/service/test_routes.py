"""Every route through TestClient, with the fake model behind the real index code."""

import io
import json
import logging
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.deps import get_engine
from service.main import create_app
from service.retrieval import RetrievalEngine
from tests.service.conftest import sketch_png
from training.cdk.model.smoothing import Expansion


def post(client, data: bytes, name="s.png", **params):
    return client.post("/retrieve", params=params, files={"file": (name, data, "image/png")})


def expected_ranking(engine, png: bytes, d: int):
    """Brute force: the sketch embedding's d-prefix against every stored photo vector."""
    q = engine.model.embed([Image.open(io.BytesIO(png)).convert("RGB")], "sketch")[0, :d]
    photos = engine.gallery.index.reconstruct_n(0, len(engine.gallery))[:, :d]
    scores = photos @ q
    order = np.argsort(-scores, kind="stable")
    return [engine.gallery.photos[i].id for i in order], scores[order]


def test_health(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_health_is_503_until_loaded(settings):
    app = create_app(settings, loader=lambda s: None)
    r = TestClient(app).get("/health")  # no lifespan: nothing loaded
    assert r.status_code == 503 and "not loaded" in r.json()["detail"]


def test_dependency_override_serves_another_engine(settings, engine):
    app = create_app(settings, loader=lambda s: None)
    app.dependency_overrides[get_engine] = lambda: engine
    r = TestClient(app).post("/retrieve", files={"file": ("s.png", sketch_png(), "image/png")})
    assert r.status_code == 200 and len(r.json()["results"]) == 5


def test_info(client, engine):
    info = client.get("/info").json()
    assert info["width"] == 8 and info["encoder"] == "torch"
    assert info["backbone"] == "fake-thumbnail"
    assert info["available_dims"] == {"min": 1, "max": 8}
    assert info["modes"] == 8 and info["raw_dims"] == 0
    assert info["gallery_size"] == 15 and info["classes"] == 3
    assert info["index_kind"] == "flat" and info["metric"] == "inner_product"
    assert info["index_version"] == engine.galleries.current()[1] is not None
    assert "L" not in info
    assert info["model_sha256"] == engine.model.sha256
    assert info["limits"]["max_k"] == 20 and info["model"] == "fake-model"
    assert info["query_expansion"] == {}  # the fixture's engine does not expand


@pytest.mark.parametrize("d", [1, 3, 8])
def test_retrieve_matches_brute_force(client, engine, d):
    png = sketch_png(seed=d)
    r = post(client, png, dims=d, k=7)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"dims", "k", "results"} and (body["dims"], body["k"]) == (d, 7)
    ids, scores = expected_ranking(engine, png, d)
    assert [h["id"] for h in body["results"]] == ids[:7]
    np.testing.assert_allclose([h["score"] for h in body["results"]], scores[:7], rtol=1e-5,
                               atol=1e-6)
    for h in body["results"]:
        assert set(h) == {"id", "class", "score", "url", "path"}
        assert h["url"] == f"/photos/{h['id']}" and h["class"].startswith("class")
    assert [h["score"] for h in body["results"]] == sorted(
        (h["score"] for h in body["results"]), reverse=True)


@pytest.mark.parametrize("d", [2, 8])
def test_expanded_queries_match_brute_force(settings, engine, d):
    """With query expansion the answer is brute force for the query moved toward the mean of
    its 3 best photos' d-prefixes; /info says so."""
    expanding = RetrievalEngine(engine.model, engine.gallery, settings.max_pixels,
                                expansion=Expansion(n=3, weight=0.5))
    app = create_app(settings, loader=lambda s: None)
    app.dependency_overrides[get_engine] = lambda: expanding
    client = TestClient(app)
    png = sketch_png(seed=10 + d)
    q = engine.model.embed([Image.open(io.BytesIO(png)).convert("RGB")], "sketch")[0, :d]
    photos = engine.gallery.index.reconstruct_n(0, len(engine.gallery))[:, :d]
    best = np.argsort(-(photos @ q), kind="stable")[:3]
    scores = photos @ (q + 0.5 * photos[best].mean(0))
    order = np.argsort(-scores, kind="stable")
    body = post(client, png, dims=d, k=6).json()
    assert [h["id"] for h in body["results"]] == [engine.gallery.photos[i].id
                                                  for i in order[:6]]
    np.testing.assert_allclose([h["score"] for h in body["results"]], scores[order[:6]],
                               rtol=1e-5, atol=1e-6)
    assert client.get("/info").json()["query_expansion"] == {"n": 3, "weight": 0.5,
                                                                "rescore": 10}


def test_defaults_and_timing_header(client):
    r = post(client, sketch_png())
    assert (r.json()["dims"], r.json()["k"], len(r.json()["results"])) == (8, 5, 5)
    stages = [part.split(";")[0] for part in r.headers["server-timing"].split(", ")]
    assert stages == ["decode", "preprocess", "encode", "search"]


def test_k_beyond_gallery_returns_all_photos(client):
    body = post(client, sketch_png(), k=20).json()
    assert body["k"] == 20 and len(body["results"]) == 15


def test_batch_equals_single_requests(client):
    pngs = [sketch_png(seed=s) for s in range(3)]
    r = client.post("/retrieve/batch", params={"dims": 4, "k": 3},
                    files=[("files", (f"q{i}.png", p, "image/png")) for i, p in enumerate(pngs)])
    assert r.status_code == 200
    body = r.json()
    assert (body["dims"], body["k"]) == (4, 3)
    assert [q["filename"] for q in body["queries"]] == ["q0.png", "q1.png", "q2.png"]
    for png, q in zip(pngs, body["queries"], strict=True):
        single = post(client, png, dims=4, k=3).json()["results"]
        assert [h["id"] for h in q["results"]] == [h["id"] for h in single]
        np.testing.assert_allclose([h["score"] for h in q["results"]],
                                   [h["score"] for h in single], rtol=1e-5)


def test_batch_over_limit(client):
    files = [("files", (f"q{i}.png", sketch_png(seed=i), "image/png")) for i in range(5)]
    r = client.post("/retrieve/batch", files=files)
    assert r.status_code == 413 and "5 files is over the batch limit of 4" in r.json()["detail"]


def test_batch_names_the_bad_file(client):
    files = [("files", ("good.png", sketch_png(), "image/png")),
             ("files", ("bad.png", b"hello", "image/png"))]
    r = client.post("/retrieve/batch", files=files)
    assert r.status_code == 415 and "'bad.png'" in r.json()["detail"]


def test_photo_is_served(client, engine):
    hit = post(client, sketch_png(), k=1).json()["results"][0]
    r = client.get(hit["url"])
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    assert r.content == engine.read_photo(hit["id"])[0]
    assert Image.open(io.BytesIO(r.content)).size == (32, 32)


def png_with_size(width: int, height: int) -> bytes:
    """A valid tiny PNG whose header claims width x height (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, "PNG")
    raw = bytearray(buf.getvalue())
    ihdr = raw[12:29]  # b"IHDR" + 13 bytes of data
    ihdr[4:12] = struct.pack(">II", width, height)
    raw[12:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(raw)


BAD_UPLOADS = [
    ("empty", b"", 400, "is empty"),
    ("text", b"this is not an image at all", 415, "is not a PNG/JPEG/WEBP image"),
    ("truncated", sketch_png(size=128)[:300], 400, "truncated"),
    ("bomb", png_with_size(60_000, 60_000), 413, "too many pixels"),
    ("large", png_with_size(2000, 2000), 413, "2000x2000 = 4000000 pixels; the limit is 1000000"),
    ("oversize", b"\x89PNG" + b"0" * 200_000, 413, "over the limit of 200000 bytes"),
]


@pytest.mark.parametrize("case,data,status,message", BAD_UPLOADS, ids=[c[0] for c in BAD_UPLOADS])
def test_bad_uploads_get_4xx_and_service_keeps_serving(client, case, data, status, message):
    r = post(client, data, name=f"{case}.png")
    assert r.status_code == status, r.text
    assert message in r.json()["detail"] and f"'{case}.png'" in r.json()["detail"]
    assert post(client, sketch_png()).status_code == 200


def test_body_over_limit_is_refused_before_parsing(client, settings):
    big = b"0" * (settings.max_body_bytes + 1)
    r = post(client, big)
    assert r.status_code == 413 and r.json()["detail"].startswith("request body of ")


def test_streamed_body_over_limit_is_refused(client, settings):
    # No Content-Length: the limit is enforced while the body streams in.
    def chunks():
        boundary = b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\""
        yield boundary + b"\r\nContent-Type: image/png\r\n\r\n"
        for _ in range(settings.max_body_bytes // 65536 + 2):
            yield b"0" * 65536
        yield b"\r\n--xyz--\r\n"

    r = client.post("/retrieve", content=chunks(),
                    headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 413
    assert r.json()["detail"].startswith("request body is over the limit")
    assert post(client, sketch_png()).status_code == 200


def test_missing_file_field(client):
    r = client.post("/retrieve", files={"other": ("s.png", sketch_png(), "image/png")})
    assert r.status_code == 422 and "file" in r.text


@pytest.mark.parametrize("params,message", [
    ({"dims": 9}, "dims=9 is outside [1, 8]"),  # the index's bound (engine)
    ({"k": 21}, "k=21 is outside [1, 20]"),  # the settings' bound (route)
])
def test_dims_and_k_above_their_bounds(client, params, message):
    r = post(client, sketch_png(), **params)
    assert r.status_code == 422 and r.json()["detail"] == message
    batch = client.post("/retrieve/batch", params=params,
                        files=[("files", ("s.png", sketch_png(), "image/png"))])
    assert batch.status_code == 422 and batch.json()["detail"] == message


@pytest.mark.parametrize("params", [{"dims": 0}, {"dims": -3}, {"k": 0}])
def test_dims_and_k_below_one_are_refused_at_the_edge(client, params):
    (name, value), = params.items()
    r = post(client, sketch_png(), **params)
    assert r.status_code == 422  # names the parameter and the bound, not the value sent
    assert r.json() == {"detail": f"query.{name}: Input should be greater than or equal to 1"}


def test_non_integer_dims(client):
    r = post(client, sketch_png(), dims="many")
    assert r.status_code == 422 and "dims" in r.text


@pytest.mark.parametrize("path", [
    "/photos/no_such_photo",
    "/photos/%2E%2E",
    "/photos/..%2F..%2F..%2Fetc%2Fpasswd",
    "/photos/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/photos/..%5C..%5Cetc%5Cpasswd",
    "/photos/class0%2Fc0_0_000.jpg",
])
def test_unknown_ids_and_path_traversal_are_404(client, path):
    r = client.get(path)
    assert r.status_code == 404
    assert "root:" not in r.text


def test_unknown_photo_names_the_id(client):
    r = client.get("/photos/no_such_photo")
    assert r.json()["detail"] == "no photo with id 'no_such_photo' in the index"


def test_access_log_has_latency(client, caplog):
    with caplog.at_level(logging.INFO, logger="service.access"):
        post(client, sketch_png(), dims=2, k=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "service.access"]
    assert any(line.startswith("testclient key=- POST /retrieve?dims=2&k=3 200 ")
               and line.endswith("ms")
               for line in lines), lines


def test_web_page_and_assets(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for needle in ('id="canvas"', 'id="upload"', 'id="dims"', 'id="results"', "/static/app.js"):
        assert needle in page.text
    js = client.get("/static/app.js")
    assert js.status_code == 200 and "pointerdown" in js.text and "touchstart" in js.text
    assert client.get("/static/style.css").status_code == 200


def test_cors_preflight(client):
    r = client.options("/retrieve", headers={"Origin": "http://example.test",
                                            "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://example.test"


def test_settings_from_environment(monkeypatch, tmp_path):
    from service.settings import Settings

    monkeypatch.setenv("SKETCHSVD_INDEX", str(tmp_path))
    monkeypatch.setenv("SKETCHSVD_MAX_K", "7")
    monkeypatch.setenv("SKETCHSVD_CORS_ORIGINS", '["http://a.test", "http://b.test"]')
    s = Settings()
    assert (s.index, s.max_k, s.cors_origins) == (tmp_path, 7, ["http://a.test", "http://b.test"])
    assert Settings(max_k=3).max_k == 3  # explicit values win over the environment
    monkeypatch.setenv("SKETCHSVD_MAX_K", "0")
    with pytest.raises(ValueError, match="max_k"):
        Settings()


def test_photos_dir_override(tmp_path, fake_index, settings):
    import shutil

    from index.store import load_index
    from service.retrieval import RetrievalEngine

    index_dir, embedder = fake_index
    gallery = load_index(index_dir)
    moved = tmp_path / "moved"
    engine = RetrievalEngine(embedder, gallery, settings.max_pixels, photos_root=moved)
    client = TestClient(create_app(settings, loader=lambda s: engine))
    with client:
        r = client.get("/photos/c0_0_000")
        assert r.status_code == 404 and "is indexed but" in r.json()["detail"]
        assert str(tmp_path) not in r.text and "c0_0_000.jpg" not in r.text  # no server path
        shutil.copytree(gallery.sidecar.photos_root, moved)
        r = client.get("/photos/c0_0_000")
        assert r.status_code == 200 and r.content == (moved / "class0/c0_0_000.jpg").read_bytes()


@pytest.fixture
def own_gallery(tmp_path, settings):
    """A gallery and index of this test only (tests below change the gallery), its client,
    and a secret file beside the gallery that must never be served."""
    from index.build import build_index
    from index.store import load_index
    from service.retrieval import RetrievalEngine
    from tests.fakes import FakeModel, make_gallery

    photos = make_gallery(tmp_path / "photos", classes=2, per_class=2)
    secret = tmp_path / "secret.jpg"
    Image.new("RGB", (16, 16), "red").save(secret)
    embedder = FakeModel(L=8)
    build_index(embedder, photos, tmp_path / "index", progress=False)
    engine = RetrievalEngine(embedder, load_index(tmp_path / "index"), settings.max_pixels)
    with TestClient(create_app(settings, loader=lambda s: engine)) as client:
        yield client, photos, secret


def test_photo_replaced_by_a_link_to_outside_after_the_build_is_not_served(own_gallery,
                                                                           tmp_path):
    client, photos, secret = own_gallery
    photo = photos / "class0" / "c0_0_000.jpg"
    assert client.get("/photos/c0_0_000").status_code == 200
    photo.unlink()
    photo.symlink_to(secret)
    r = client.get("/photos/c0_0_000")
    assert r.status_code == 404 and secret.read_bytes() not in r.content
    assert r.json()["detail"] == ("photo 'c0_0_000' is indexed but its file is not below the "
                                  "photo folder")
    # A whole class folder swapped for a link to a folder outside holding the same names.
    outside = tmp_path / "outside"
    outside.mkdir()
    (photos / "class1").rename(outside / "class1")
    (photos / "class1").symlink_to(outside / "class1")
    r = client.get("/photos/c1_0_000")
    assert r.status_code == 404 and str(tmp_path) not in r.text


def test_link_inside_the_gallery_is_served(own_gallery):
    client, photos, _ = own_gallery
    photo = photos / "class0" / "c0_0_000.jpg"
    data = photo.read_bytes()
    photo.rename(photos / "class0" / ".moved.jpg")
    photo.symlink_to(photos / "class0" / ".moved.jpg")
    r = client.get("/photos/c0_0_000")
    assert r.status_code == 200 and r.content == data


def test_missing_photo_is_404_without_server_paths(own_gallery, tmp_path):
    client, photos, _ = own_gallery
    (photos / "class0" / "c0_0_001.jpg").unlink()
    r = client.get("/photos/c0_0_001")
    assert r.status_code == 404
    assert r.json()["detail"] == ("photo 'c0_0_001' is indexed but its file is missing or "
                                  "unreadable")
    assert str(tmp_path) not in r.text and "/" not in r.json()["detail"]


def test_file_is_opened_without_following_a_link_swapped_in_after_the_check(tmp_path):
    """read_below walks real folders only: a link placed between the resolve-and-check and
    the open (a race) is refused, as a file, a folder or a FIFO."""
    import os

    from service.photo_files import read_below

    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "b.jpg").write_bytes(b"photo")
    (tmp_path / "secret").write_bytes(b"secret")
    assert read_below(root, Path("a/b.jpg")) == b"photo"
    (root / "a" / "b.jpg").unlink()
    (root / "a" / "b.jpg").symlink_to(tmp_path / "secret")
    with pytest.raises(OSError):
        read_below(root, Path("a/b.jpg"))
    (root / "a").rename(root / "real")
    (root / "a").symlink_to(root / "real")
    with pytest.raises(OSError):
        read_below(root, Path("a/b.jpg"))
    os.mkfifo(root / "real" / "pipe.jpg")
    with pytest.raises(OSError, match="not a regular file"):
        read_below(root, Path("real/pipe.jpg"))


def test_a_table_row_whose_path_leaves_the_root_is_not_served(tmp_path, settings, monkeypatch):
    """Rows are read lazily, so a table written by other code with a path out of the photo
    root loads; that photo is refused when asked for, the others are served."""
    import index.table as table_mod
    from index.build import build_index
    from index.store import SIDECAR_FILE, _digests, current_version, load_index
    from index.table import TABLE_FILES, PhotoTable, write_table
    from service.retrieval import RetrievalEngine
    from tests.fakes import FakeModel, make_gallery

    photos = make_gallery(tmp_path / "photos", classes=2, per_class=2)
    secret = tmp_path / "secret.jpg"
    Image.new("RGB", (16, 16), "red").save(secret)
    embedder = FakeModel(L=8)
    build_index(embedder, photos, tmp_path / "index", progress=False)
    version = current_version(tmp_path / "index")
    rows = list(PhotoTable.open(version))
    rows[1] = type(rows[1])(rows[1].id, rows[1].cls, "../secret.jpg")
    for name in TABLE_FILES:
        (version / name).unlink()
    monkeypatch.setattr(table_mod, "leaves_root", lambda path: False)  # other code's writer
    write_table(version, rows)
    monkeypatch.undo()
    sidecar = json.loads((version / SIDECAR_FILE).read_text())  # a version it wrote whole
    (version / SIDECAR_FILE).write_text(json.dumps({**sidecar, "files": _digests(version)}))
    engine = RetrievalEngine(embedder, load_index(tmp_path / "index"), settings.max_pixels)
    with TestClient(create_app(settings, loader=lambda s: engine)) as client:
        r = client.get(f"/photos/{rows[1].id}")
        assert r.status_code == 404 and secret.read_bytes() not in r.content
        assert r.json()["detail"] == (f"photo '{rows[1].id}' is indexed but its table row is "
                                      "damaged")
        assert client.get(f"/photos/{rows[0].id}").status_code == 200
