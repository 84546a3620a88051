"""Startup: which checkpoint is served, and refusing a checkpoint that does not match."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from fastapi.testclient import TestClient

from index.store import SIDECAR_FILE, IndexMismatchError, current_version, read_sidecar
from service.loading import find_checkpoint
from service.main import create_app
from service.settings import Settings
from training.cdk.model.smoothing import RESCORE


def test_checkpoint_from_setting_then_sidecar_then_next_to_index(tmp_path, real_index,
                                                                 real_checkpoint):
    assert find_checkpoint(Settings(index=real_index, checkpoint=tmp_path / "x.pt")) == (
        tmp_path / "x.pt")
    assert find_checkpoint(Settings(index=real_index)) == real_checkpoint
    moved = tmp_path / "run" / "index"
    shutil.copytree(real_index, moved)
    side = dataclasses.asdict(read_sidecar(moved))
    (current_version(moved) / SIDECAR_FILE).write_text(
        json.dumps({**side, "checkpoint": "/gone/checkpoint.pt"}))
    with pytest.raises(FileNotFoundError, match="tried '/gone/checkpoint.pt'"):
        find_checkpoint(Settings(index=moved))
    shutil.copy(real_checkpoint, moved.parent / "checkpoint.pt")
    assert find_checkpoint(Settings(index=moved)) == moved.parent / "checkpoint.pt"


def test_startup_refuses_another_checkpoint(tmp_path, real_index, caplog):
    from training.cdk.model.checkpoint import init_checkpoint

    other = init_checkpoint(tmp_path / "other.pt", modes=8, hidden=16, image_size=64, seed=2,
                            raw_dims=0)
    app = create_app(Settings(index=real_index, checkpoint=other))
    with pytest.raises(IndexMismatchError, match="was built from checkpoint sha256"):
        with TestClient(app):
            pass
    assert any("cannot start" in r.getMessage() for r in caplog.records)


def test_startup_loads_the_real_engine(real_index, small_sketches):
    with TestClient(create_app(Settings(index=real_index))) as client:
        r = client.post("/retrieve", params={"dims": 8, "k": 15},
                        files={"file": ("q.png", small_sketches[0], "image/png")})
        assert r.status_code == 200 and len(r.json()["results"]) == 15
        info = client.get("/info").json()
        assert info["model"] == "checkpoint.pt"
        # the checkpoint's expansion; the settings' re-scoring, whose default is training's
        assert info["query_expansion"] == {"n": 5, "weight": 0.5, "rescore": 10}
        assert Settings().expand_rescore == RESCORE == 10


def test_expand_n_setting_overrides_the_checkpoint(real_index, small_sketches):
    """EXPAND_N=0 answers with one search: the scores are the sketch's own inner products,
    and they differ from the expanded ones."""
    scores = {}
    for n in (None, 0):
        settings = Settings(index=real_index, expand_n=n, encoder="torch")
        with TestClient(create_app(settings)) as client:
            r = client.post("/retrieve", params={"dims": 8, "k": 5},
                            files={"file": ("q.png", small_sketches[0], "image/png")})
            scores[n] = [h["score"] for h in r.json()["results"]]
            want = {} if n == 0 else {"n": 5, "weight": 0.5, "rescore": 10}
            assert client.get("/info").json()["query_expansion"] == want
            if n == 0:
                engine = client.app.state.engine
                image = engine.decode("q.png", small_sketches[0])  # as the service decodes
                q = engine.embedder.embed([image], "sketch")[0, :8]
                photos = engine.gallery.index.reconstruct_n(0, len(engine.gallery))[:, :8]
                np.testing.assert_allclose(scores[0], np.sort(photos @ q)[::-1][:5],
                                           rtol=1e-4, atol=1e-5)
    assert not np.allclose(scores[None], scores[0])


def test_startup_with_an_incomplete_checkpoint_says_which_keys_are_missing(tmp_path, real_index,
                                                                           real_checkpoint,
                                                                           caplog):
    import torch

    from training.cdk.model.checkpoint import load_checkpoint

    obj = load_checkpoint(real_checkpoint)
    del obj["head_arch"]
    torch.save(obj, tmp_path / "cut.pt")
    app = create_app(Settings(index=real_index, checkpoint=tmp_path / "cut.pt"))
    with pytest.raises(ValueError, match="cut.pt' is an incomplete CDK checkpoint: it lacks "
                                         "head_arch"):
        with TestClient(app):
            pass
    logged = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert logged and "cut.pt' is an incomplete CDK checkpoint: it lacks head_arch" in logged[0]


def test_a_gpu_index_is_searched_one_call_at_a_time(real_index, monkeypatch):
    # No GPU here: pretend one, with an identity "copy to GPU", and check the wrapping.
    import service.loading
    from index.gpu import SerializedIndex
    from service.loading import load_engine
    from service.settings import Settings

    monkeypatch.setattr(service.loading, "gpu_available", lambda: True)
    monkeypatch.setattr(service.loading, "to_gpu", lambda index: index)
    engine = load_engine(Settings(index=real_index))
    assert isinstance(engine.gallery.index, SerializedIndex)
    scores, rows = engine.gallery.search(np.zeros((2, 3), np.float32), 4)
    assert rows.shape == (2, 4)
