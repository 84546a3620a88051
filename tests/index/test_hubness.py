"""The hubness correction stored with the photos (index.hubness): a corrected index ranks a
full-width query by score - penalty, exactly, in every path that writes vectors (build,
sharded build, add), and a d-prefix query ignores it; the service appends the query's 1."""

import numpy as np
import torch
from fastapi.testclient import TestClient

from index.add import append_photos
from index.build import build_index
from index.gallery import scan_gallery
from index.sharded import build_sharded
from index.store import load_index
from service.main import create_app
from service.retrieval import RetrievalEngine
from service.settings import Settings
from tests.fakes import FakeModel, make_gallery
from tests.service.conftest import sketch_png
from training.cdk.model.hubness import Hubness, photo_penalty
from training.images import load_image

HUB = Hubness(k=3, weight=0.5)


def corrected_model(L=8, seed=0):
    sample = torch.randn(20, L, generator=torch.Generator().manual_seed(7))
    return FakeModel(L=L, seed=seed, hubness=HUB, sample=sample)


def plain(model, folder):
    scan = scan_gallery(folder)
    return model.embed([load_image(scan.root / p.path) for p in scan.photos], "photo")


def test_a_corrected_index_ranks_by_score_minus_penalty(tmp_path):
    model = corrected_model()
    photos = make_gallery(tmp_path / "photos", classes=3, per_class=5)
    report = build_index(model, photos, tmp_path / "ix", progress=False)
    assert report.sidecar.hubness == HUB.as_dict() and report.sidecar.dims == 8
    ix = load_index(tmp_path / "ix")
    assert ix.corrected and ix.index.d == 9 and ix.query_width(8) == 9 and ix.query_width(4) == 4
    g = plain(model, photos)  # (15, 8): no smoothing in the fake
    penalty = photo_penalty(torch.from_numpy(g), model.hubness_sample(), HUB).numpy()
    np.testing.assert_allclose(ix.index.reconstruct_n(0, 15)[:, 8], -penalty, rtol=1e-5)
    q = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    scores, rows = ix.search(np.hstack([q, np.ones((4, 1), np.float32)]), k=15)
    brute = q @ g.T - penalty  # (4, 15)
    np.testing.assert_allclose(scores, -np.sort(-brute, axis=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(rows[:, 0], brute.argmax(1))
    s4, _ = ix.search(q[:, :4], k=15)  # a prefix query reads no penalty
    np.testing.assert_allclose(s4, -np.sort(-(q[:, :4] @ g[:, :4].T), axis=1), rtol=1e-4,
                               atol=1e-5)
    # a shorter prefix stored: no correction (the penalty is of the whole width)
    short = build_index(model, photos, tmp_path / "short", dims=6, progress=False)
    assert short.sidecar.hubness == {} and load_index(tmp_path / "short").index.d == 6


def test_every_path_stores_the_same_corrected_vectors(tmp_path):
    model = corrected_model()
    photos = make_gallery(tmp_path / "photos", classes=3, per_class=5)
    build_index(model, photos, tmp_path / "a", progress=False)
    build_sharded(model, photos, tmp_path / "b", shard_size=4, kind="flat", progress=False,
                  max_index_memory="1G")
    make_gallery(tmp_path / "grow", classes=1, per_class=5, seed=0)
    build_index(model, tmp_path / "grow", tmp_path / "c", progress=False)
    extra = make_gallery(tmp_path / "grow" / "more", classes=2, per_class=5, seed=3)
    append_photos(model, tmp_path / "c", extra, progress=False)
    a = load_index(tmp_path / "a").index.reconstruct_n(0, 15)
    np.testing.assert_array_equal(load_index(tmp_path / "b").index.reconstruct_n(0, 15), a)
    grown = load_index(tmp_path / "c")
    g = plain(model, tmp_path / "grow")
    rows = {p.path: i for i, p in enumerate(scan_gallery(tmp_path / "grow").photos)}
    stored = grown.index.reconstruct_n(0, len(grown))
    order = [rows[p.path] for p in grown.photos]
    penalty = photo_penalty(torch.from_numpy(g), model.hubness_sample(), HUB).numpy()
    np.testing.assert_allclose(stored[:, 8], -penalty[order], rtol=1e-5)  # added ones too


def test_the_service_appends_the_queries_one(tmp_path):
    model = corrected_model()
    photos = make_gallery(tmp_path / "photos", classes=3, per_class=5)
    build_index(model, photos, tmp_path / "ix", progress=False)
    settings = Settings(index=tmp_path / "ix", max_k=20)
    engine = RetrievalEngine(model, load_index(tmp_path / "ix"), settings.max_pixels)
    g = plain(model, photos)
    penalty = photo_penalty(torch.from_numpy(g), model.hubness_sample(), HUB).numpy()
    png = sketch_png(seed=2)
    with TestClient(create_app(settings, loader=lambda s: engine)) as client:
        assert client.get("/info").json()["hubness_correction"] == HUB.as_dict()
        q = model.embed([engine.decode("q.png", png)], "sketch")[0]
        for dims, want in ((8, q @ g.T - penalty), (4, q[:4] @ g[:, :4].T)):
            r = client.post("/retrieve", params={"dims": dims, "k": 15},
                            files={"file": ("q.png", png, "image/png")})
            assert r.status_code == 200
            got = [h["score"] for h in r.json()["results"]]
            np.testing.assert_allclose(got, np.sort(want)[::-1], rtol=1e-4, atol=1e-5)
