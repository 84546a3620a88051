"""Startup: which model bundle is served, refusing one that does not match the index, and
starting from what is on disk alone (no training data, no writes, the same precision every
time)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from index.store import SIDECAR_FILE, IndexMismatchError, current_version, read_sidecar
from service.loading import find_model, load_engine
from service.main import create_app
from service.settings import Settings
from tests.bundles import untrained_bundle
from tests.conftest import REPO
from tests.service.conftest import service_process
from training.cdk.model.bundle import MODEL_FILE, BundleError
from training.cdk.model.smoothing import RESCORE


def test_model_from_setting_then_sidecar(tmp_path, real_index, real_bundle):
    assert find_model(Settings(index=real_index, model=tmp_path / "m")) == tmp_path / "m"
    assert find_model(Settings(index=real_index)) == real_bundle.path
    moved = tmp_path / "run" / "index"
    shutil.copytree(real_index, moved)
    side = dataclasses.asdict(read_sidecar(moved))
    (current_version(moved) / SIDECAR_FILE).write_text(json.dumps({**side, "model": "/gone"}))
    with pytest.raises(FileNotFoundError, match="is not at '/gone'; set SKETCHSVD_MODEL"):
        find_model(Settings(index=moved))


def test_startup_refuses_another_model(tmp_path, real_index, caplog):
    other = untrained_bundle(tmp_path, modes=8, hidden=16, image_size=64, seed=2, raw_dims=0,
                             sketch_flip_average=False)
    app = create_app(Settings(index=real_index, model=other.path))
    with pytest.raises(IndexMismatchError, match="was built with the model bundle of sha256"):
        with TestClient(app):
            pass
    assert any("cannot start" in r.getMessage() for r in caplog.records)


def test_a_bundle_of_another_version_names_the_command_that_rewrites_it(tmp_path, real_index,
                                                                         real_bundle):
    model = shutil.copytree(real_bundle.path, tmp_path / "model")
    doc = json.loads((model / MODEL_FILE).read_text())
    (model / MODEL_FILE).write_text(json.dumps({**doc, "version": 0}))
    with pytest.raises(BundleError, match="of version 0; this code reads version 1. Write it "
                                          "again: python -m training.cdk.make_bundle"):
        load_engine(Settings(index=real_index, model=model))
    with pytest.raises(BundleError, match="is a file, not a model bundle folder"):
        load_engine(Settings(index=real_index, model=model / MODEL_FILE))


def test_startup_loads_the_real_engine(real_index, real_bundle, small_sketches):
    with TestClient(create_app(Settings(index=real_index, device="cpu"))) as client:
        r = client.post("/retrieve", params={"dims": 8, "k": 15},
                        files={"file": ("q.png", small_sketches[0], "image/png")})
        assert r.status_code == 200 and len(r.json()["results"]) == 15
        info = client.get("/info").json()
        assert (info["model"], info["model_sha256"]) == (str(real_bundle.path),
                                                         real_bundle.sha256)
        assert (info["encoder"], info["precision"]) == ("onnxruntime", "fp32")
        # the bundle's expansion; the settings' re-scoring, whose default is training's
        assert info["query_expansion"] == {"n": 5, "weight": 0.5, "rescore": 10}
        assert Settings().expand_rescore == RESCORE == 10


def test_expand_n_setting_overrides_the_models(real_index, small_sketches):
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
                q = engine.model.embedder("cpu").embed([image], "sketch")[0, :8]
                photos = engine.gallery.index.reconstruct_n(0, len(engine.gallery))[:, :8]
                np.testing.assert_allclose(scores[0], np.sort(photos @ q)[::-1][:5],
                                           rtol=1e-4, atol=1e-5)
    assert not np.allclose(scores[None], scores[0])


def test_a_gpu_index_is_searched_one_call_at_a_time(real_index, monkeypatch):
    # No GPU here: pretend one, with an identity "copy to GPU", and check the wrapping.
    import service.loading
    from index.gpu import SerializedIndex

    monkeypatch.setattr(service.loading, "gpu_available", lambda: True)
    monkeypatch.setattr(service.loading, "to_gpu", lambda index: index)
    engine = load_engine(Settings(index=real_index, device="cpu"))
    assert isinstance(engine.gallery.index, SerializedIndex)
    scores, rows = engine.gallery.search(np.zeros((2, 3), np.float32), 4)
    assert rows.shape == (2, 4)


def snapshot(*folders) -> dict:
    """Every entry below `folders`: (size, mtime) of files, and the folders themselves."""
    out = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                p = os.path.join(root, name)
                st = os.lstat(p)
                out[p] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


# Run the service with an audit hook that fails any open for writing below the watched
# folders (Python-level opens: the index reader, the bundle reader, the service itself).
AUDITED = """
import os, runpy, sys
watched = [os.path.realpath(p) for p in os.environ["WATCHED"].split(os.pathsep)]
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        real = os.path.realpath(os.fsdecode(path))
        if writes and any(real == w or real.startswith(w + os.sep) for w in watched):
            print("WRITE", real, mode, flags, file=sys.stderr, flush=True)
            os._exit(3)
sys.addaudithook(hook)
sys.argv = ["service", *sys.argv[1:]]
runpy.run_module("service", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_trained_model_serves_a_new_photo_folder_without_its_training_data(
        tmp_path, sketchy_mini):
    """Train-side: a bundle written where the data is (int8 calibrated on it). Then the data
    is moved away; index.build indexes another folder (flat, spaces and non-ASCII in names,
    a stray file) and the service starts on it twice, read only, in the bundle's precision,
    and answers with those photos."""
    import training.cdk.quantize as quantize_mod

    data = tmp_path / "train-data"
    classes = sorted(p.name for p in (sketchy_mini / "photo").iterdir())
    for side in ("photo", "sketch"):
        for cls in classes[:10]:
            shutil.copytree(sketchy_mini / side / cls, data / side / cls)
    with pytest.MonkeyPatch.context() as mp:  # any int8 graph holds parity: this is about
        mp.setattr(quantize_mod, "PARITY_OVERLAP", 0.0)  # where it is made and served
        mp.setattr(quantize_mod, "PARITY_MAP_DROP", 1.0)
        model = untrained_bundle(tmp_path / "run", data=data, split="none", modes=8,
                                 hidden=16, image_size=64, raw_dims=0,
                                 sketch_flip_average=False)
    assert model.encoders["sketch"].graphs["int8"] and model.encoders["sketch"].parity
    data.rename(tmp_path / "moved-away")  # the serving host has no training data

    photos = tmp_path / "my photos"
    photos.mkdir()
    for cls in classes[10:13]:
        for j, f in enumerate(sorted((sketchy_mini / "photo" / cls).iterdir())[:4]):
            shutil.copyfile(f, photos / (f"{cls} {j}.jpg" if j % 2 else f"été {cls}_{j}.jpg"))
    (photos / "notes.txt").write_text("not a photo")
    index = tmp_path / "index"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "index.build", "--model", str(model.path), "--photos",
         str(photos), "--out", str(index), "--threads", "1", "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert "12 photos, kind=flat" in built.stdout
    assert "skipped 1 files that are not images: notes.txt" in built.stdout
    # photos in one view (the default): the single-view graph, in the bundle's precision
    single = model.encoders["photo-single-view"]
    assert single.graphs["int8"] and single.parity
    assert f"onnxruntime {single.precision} photo encoder" in built.stdout

    before = snapshot(index, model.path)
    sketch = sorted((sketchy_mini / "sketch" / classes[11]).iterdir())[0].read_bytes()
    precisions = []
    for _ in range(2):
        with service_process(index, "--threads", "1", WATCHED=os.pathsep.join(
                [str(index), str(model.path)]), _runner=AUDITED) as (url, proc):
            info = httpx.get(f"{url}/info", timeout=30).json()
            precisions.append(info["precision"])
            r = httpx.post(f"{url}/retrieve", params={"k": 12},
                           files={"file": ("q.png", sketch, "image/png")}, timeout=60)
            assert r.status_code == 200, r.text
            hits = r.json()["results"]
            assert sorted(h["path"] for h in hits) == sorted(
                p.name for p in photos.iterdir() if p.suffix == ".jpg")
            assert all(h["class"] is None for h in hits)  # a flat folder has no classes
            photo = httpx.get(f"{url}{hits[0]['url']}", timeout=30)
            assert photo.status_code == 200 and photo.content == (photos / hits[0]["path"]
                                                                  ).read_bytes()
    assert precisions == [model.encoders["sketch"].precision] * 2 == ["int8"] * 2
    assert snapshot(index, model.path) == before  # nothing written, nothing added


def test_the_write_audit_catches_a_write(tmp_path):
    """The audit runner above can fail: a write below a watched folder ends the process."""
    code = AUDITED.replace('runpy.run_module("service", run_name="__main__", alter_sys=True)',
                           f'open({str(tmp_path / "x")!r}, "w")')
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                          "WATCHED": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "WRITE" in done.stderr
    read = subprocess.run([sys.executable, "-c", code.replace('"w")', '"r")')],
                          env={**os.environ, "WATCHED": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)
    assert "WRITE" not in read.stderr  # reading is allowed (the file does not exist: an error)
