"""Gallery smoothing in the index: FAISS neighbours against training's exact search, the
stored vectors of a build and an append against the rule applied in torch, the sidecar, and
the same vectors on every build path (in memory, shards, blocks of any size)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import index.neighbours as neighbours_mod
from index import add as add_mod
from index.blocks import array_blocks, concat
from index.build import build_index
from index.gallery import scan_gallery
from index.kinds import get
from index.neighbours import (
    faiss_neighbours,
    model_smoothing,
    smooth_added,
    smooth_blocks,
)
from index.store import load_index
from tests.fakes import FakeModel, make_gallery
from training.cdk.model.smoothing import Smoothing, exact_neighbours, smooth


def _photo_embeddings(embedder, folder):
    scan = scan_gallery(folder)
    root, photos = scan.root, scan.photos
    return embedder.embed([Image.open(root / p.path) for p in photos], "photo")


def test_faiss_neighbours_equal_exact_ones():
    g = torch.randn(300, 12, generator=torch.Generator().manual_seed(0))
    rows = torch.arange(300)
    np.testing.assert_array_equal(faiss_neighbours(g, 7, rows).numpy(),
                                  exact_neighbours(g, 7, rows).numpy())
    some = torch.tensor([5, 299, 0])
    np.testing.assert_array_equal(faiss_neighbours(g, 7, some).numpy(),
                                  exact_neighbours(g, 7, some).numpy())


def test_the_code_index_branch_finds_the_exact_neighbours(monkeypatch):
    monkeypatch.setattr(neighbours_mod, "EXACT_MAX", 10)
    g = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    rows = torch.arange(500)
    got, want = faiss_neighbours(g, 5, rows).numpy(), exact_neighbours(g, 5, rows).numpy()
    assert (got != np.arange(500)[:, None]).all()  # never itself
    same = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(got, want, strict=True)])
    assert same > 0.98, same


def test_duplicate_photos_never_count_themselves():
    g = torch.randn(10, 4, generator=torch.Generator().manual_seed(2))
    g = torch.cat([g, g[:3]])  # rows 10-12 repeat rows 0-2 exactly
    idx = faiss_neighbours(g, 3, torch.arange(13)).numpy()
    assert (idx != np.arange(13)[:, None]).all()
    assert idx[0, 0] == 10 and idx[10, 0] == 0


def test_build_stores_smoothed_vectors_and_says_so(tmp_path):
    gallery = make_gallery(tmp_path / "photos", classes=4, per_class=6)
    embedder = FakeModel(L=8)
    cfg = Smoothing(k=3, weight=2.0, rounds=2)
    build_index(embedder, gallery, tmp_path / "ix", progress=False, smoothing=cfg)
    ix = load_index(tmp_path / "ix", mmap=False)
    assert ix.sidecar.smoothing == {"k": 3, "weight": 2.0, "rounds": 2}
    want = smooth(torch.from_numpy(_photo_embeddings(embedder, gallery)), cfg).numpy()
    np.testing.assert_allclose(ix.index.reconstruct_n(0, len(ix)), want, rtol=1e-5, atol=1e-6)

    build_index(embedder, gallery, tmp_path / "plain", progress=False,
                smoothing=Smoothing(k=0))
    plain = load_index(tmp_path / "plain", mmap=False)
    assert plain.sidecar.smoothing == {}
    np.testing.assert_allclose(plain.index.reconstruct_n(0, len(plain)),
                               _photo_embeddings(embedder, gallery), rtol=1e-6)


def test_a_truncated_build_keeps_the_prefix_of_the_full_smoothed_vectors(tmp_path):
    # neighbours found with all L modes: the --dims 3 index stores the first 3 coordinates
    # of what the full index stores, not the 3-dim prefixes smoothed on their own
    gallery = make_gallery(tmp_path / "photos", classes=4, per_class=6)
    embedder = FakeModel(L=8)
    cfg = Smoothing(k=3, weight=2.0, rounds=2)
    build_index(embedder, gallery, tmp_path / "ix", dims=3, progress=False,
                smoothing=cfg)
    ix = load_index(tmp_path / "ix", mmap=False)
    full = torch.from_numpy(_photo_embeddings(embedder, gallery))
    want = smooth(full, cfg)[:, :3].numpy()
    np.testing.assert_allclose(ix.index.reconstruct_n(0, len(ix)), want, rtol=1e-5, atol=1e-6)
    own = smooth(full[:, :3], cfg).numpy()
    assert np.abs(own - want).max() > 1e-3  # the two rules differ on this gallery


def test_append_smooths_new_photos_against_the_stored_ones(tmp_path):
    root = tmp_path / "photos"
    make_gallery(root, classes=3, per_class=5)
    embedder = FakeModel(L=8)
    cfg = Smoothing(k=4, weight=3.0, rounds=2)
    build_index(embedder, root, tmp_path / "ix", progress=False, smoothing=cfg)
    stored = load_index(tmp_path / "ix", mmap=False).index.reconstruct_n(0, 15)
    extra = make_gallery(root / "extra", classes=2, per_class=3, seed=7)
    add_mod.append_photos(embedder, tmp_path / "ix", extra, progress=False)
    ix = load_index(tmp_path / "ix", mmap=False)
    vectors = ix.index.reconstruct_n(0, len(ix))
    np.testing.assert_array_equal(vectors[:15], stored)  # the built photos are kept
    new = _photo_embeddings(embedder, extra)
    both = torch.from_numpy(np.concatenate([stored, new]))
    want = smooth(both, cfg, rows=torch.arange(15, 21)).numpy()[15:]
    np.testing.assert_allclose(vectors[15:], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_smooth_added_reads_the_stored_vectors_of_every_float_kind(kind):
    rng = np.random.default_rng(3)
    stored = rng.standard_normal((400, 6)).astype(np.float32)
    new = rng.standard_normal((5, 6)).astype(np.float32)
    cfg = Smoothing(k=3, weight=1.0, rounds=1)
    want = smooth(torch.from_numpy(np.concatenate([stored, new])), cfg,
                  rows=torch.arange(400, 405)).numpy()[400:]
    index = get(kind).build_vectors(stored, get(kind).plan(400, 6))
    np.testing.assert_allclose(smooth_added(get(kind).reconstruct(index, 0, 400), new, cfg),
                               want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exact_max", [10_000, 100])  # exact neighbours; a code index
def test_blocks_of_any_size_give_the_same_bits(monkeypatch, exact_max):
    """The rule over blocks (shards) equals the rule over one array, bit for bit, whatever
    the blocks, and equals training's torch rule where the neighbours are exact."""
    monkeypatch.setattr(neighbours_mod, "EXACT_MAX", exact_max)
    g = np.random.default_rng(4).standard_normal((1500, 12)).astype(np.float32)
    cfg = Smoothing(k=5, weight=2.0, rounds=2)
    whole = concat(smooth_blocks(array_blocks(g), cfg))
    for size in (7, 500, 1024):
        np.testing.assert_array_equal(concat(smooth_blocks(array_blocks(g, size), cfg)), whole)
    if exact_max > len(g):
        np.testing.assert_allclose(whole, smooth(torch.from_numpy(g), cfg).numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_model_smoothing_defaults_and_overrides():
    own = SimpleNamespace(inference=SimpleNamespace(
        gallery_smoothing=lambda: Smoothing(10, 4.0, 2)))
    assert model_smoothing(own) == Smoothing(10, 4.0, 2)
    assert model_smoothing(own, k=0) == Smoothing(0, 4.0, 2)
    assert model_smoothing(own, weight=1.5, rounds=3) == Smoothing(10, 1.5, 3)
    with pytest.raises(ValueError, match="-2"):
        model_smoothing(own, k=-2)
