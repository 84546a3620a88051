"""The index against a real model bundle (untrained, small) and real photos."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from index.gallery import scan_gallery
from index.store import IndexMismatchError, load_index
from tests.conftest import REPO
from training.cdk.model.smoothing import Smoothing, smooth
from training.images import load_image


def test_cli_builds_an_index_that_equals_brute_force(tmp_path, real_bundle, real_embedder,
                                                     small_gallery, small_sketches):
    out = tmp_path / "ix"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "index.build", "--model", str(real_bundle.path), "--photos",
         str(small_gallery), "--out", str(out), "--dims", "6", "--threads", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "15 photos, kind=flat, dims=6 of width 8 (8 modes), backbone=efficientnet-lite0" \
        in proc.stdout
    assert "embedding photos" in proc.stderr  # the progress bar
    # the bundle's own smoothing (its training config's defaults) is applied by default
    assert "gallery smoothing: 10 neighbours, weight 4.0, 2 rounds" in proc.stdout

    ix = load_index(out, model_sha256=real_embedder.sha256)
    assert ix.sidecar.backbone == "efficientnet-lite0" and ix.sidecar.width == 8
    scan = scan_gallery(small_gallery)
    root, photos = scan.root, scan.photos
    one_view = real_bundle.embedder("cpu", photo_flip_average=False)  # the default views
    gallery = one_view.embed([load_image(root / p.path) for p in photos], "photo")  # (15, 8)
    # the reference: training's rule with exact neighbours on all 8 modes, 6 dims kept
    gallery = smooth(torch.from_numpy(gallery), Smoothing(10, 4.0, 2)).numpy()[:, :6]
    sketches = real_embedder.embed(
        [Image.open(io.BytesIO(b)).convert("RGB") for b in small_sketches], "sketch")
    for d in (1, 2, 4, 6):
        brute = sketches[:, :d] @ gallery[:, :d].T
        scores, rows = ix.search(sketches[:, :d], k=15)
        np.testing.assert_allclose(scores, -np.sort(-brute, axis=1), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.take_along_axis(brute, rows, 1), scores, rtol=1e-4,
                                   atol=1e-5)


def test_an_index_of_hybrid_embeddings_equals_brute_force(tmp_path, hybrid_bundle,
                                                          small_gallery, small_sketches):
    # 8 modes then 8 raw coordinates: the index stores all 16 (smoothed with neighbours
    # found on all 16), `dims` <= 8 queries score the modes alone, 16 the whole vector
    from index.build import build_index

    e = hybrid_bundle.embedder("cpu")
    assert (e.modes, e.raw_dims, e.width) == (8, 8, 16)
    report = build_index(hybrid_bundle, small_gallery, tmp_path / "ix", progress=False)
    assert report.sidecar.width == report.sidecar.dims == 16 and report.sidecar.modes == 8
    ix = load_index(tmp_path / "ix", model_sha256=e.sha256)
    scan = scan_gallery(small_gallery)
    root, photos = scan.root, scan.photos
    one_view = hybrid_bundle.embedder("cpu", photo_flip_average=False)  # the default views
    gallery = one_view.embed([load_image(root / p.path) for p in photos], "photo")  # (15, 16)
    gallery = smooth(torch.from_numpy(gallery), Smoothing(10, 4.0, 2)).numpy()
    sketches = e.embed([Image.open(io.BytesIO(b)).convert("RGB") for b in small_sketches],
                       "sketch")
    for d in (4, 8, 16):
        brute = sketches[:, :d] @ gallery[:, :d].T
        scores, rows = ix.search(sketches[:, :d], k=15)
        np.testing.assert_allclose(scores, -np.sort(-brute, axis=1), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.take_along_axis(brute, rows, 1), scores, rtol=1e-4,
                                   atol=1e-5)


def test_another_model_is_refused(tmp_path, real_index):
    from tests.bundles import untrained_bundle

    other = untrained_bundle(tmp_path, modes=8, hidden=16, image_size=64, seed=1, raw_dims=0,
                             sketch_flip_average=False)
    with pytest.raises(IndexMismatchError, match="was built with the model bundle of sha256"):
        load_index(real_index, model_sha256=other.sha256)


def test_index_rankings_reproduce_training_evaluation(real_embedder, real_index, small_gallery):
    """mAP@all from FAISS results equals training.cdk.metrics's brute-force mAP for every d."""
    from training.cdk.metrics import retrieval_metrics

    ix = load_index(real_index, model_sha256=real_embedder.sha256)
    scan = scan_gallery(small_gallery)
    root, photos = scan.root, scan.photos
    classes = sorted({p.cls for p in photos})
    g_labels = np.array([classes.index(p.cls) for p in photos])
    # Queries: the gallery photos turned grey and posterised, one per photo, labelled by class.
    queries = [load_image(root / p.path).convert("L").point(lambda v: 255 * (v > 128))
               for p in photos]
    f = real_embedder.embed(queries, "sketch")  # (15, 8)
    g = ix.index.reconstruct_n(0, len(ix))  # (15, 8) stored photo embeddings
    for d in (1, 2, 4, 8):
        scores, rows = ix.search(f[:, :d], k=len(ix))
        rel = g_labels[rows] == g_labels[:, None]  # (15, 15) in ranked order
        cum = np.cumsum(rel, axis=1)
        ap = (rel * cum / np.arange(1, len(ix) + 1)).sum(1) / rel.sum(1)
        p5 = cum[:, 4] / 5
        ref = retrieval_metrics(f[:, :d], g[:, :d], g_labels, g_labels, k=5)
        assert abs(ap.mean() - ref["map_all"]) < 1e-6, d
        assert abs(p5.mean() - ref["precision_at_k"]) < 1e-6, d
