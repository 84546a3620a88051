"""Gallery smoothing and query expansion: the neighbour search against a brute-force loop,
the update rules against hand-written loops, their invariances, and that they help a
clustered gallery."""

import numpy as np
import pytest
import torch

from training.cdk.metrics import retrieval_metrics, service_metrics, smoothed_metrics
from training.cdk.model.smoothing import (
    Expansion,
    Smoothing,
    exact_neighbours,
    expand_exact,
    expanded_search,
    smooth,
)


def _loop_neighbours(g: np.ndarray, k: int) -> np.ndarray:
    out = []
    for i, a in enumerate(g):
        sims = [(-(a @ b) / np.linalg.norm(a) / np.linalg.norm(b), j)
                for j, b in enumerate(g) if j != i]
        out.append([j for _, j in sorted(sims)[:k]])
    return np.array(out)


def test_exact_neighbours_match_a_brute_force_loop():
    g = torch.randn(37, 6, generator=torch.Generator().manual_seed(0))
    for chunk in (5, 4096):
        idx = exact_neighbours(g, 4, torch.arange(37), chunk=chunk)
        assert idx.shape == (37, 4)
        np.testing.assert_array_equal(idx.numpy(), _loop_neighbours(g.double().numpy(), 4))
        rows = torch.tensor([30, 2, 17])
        np.testing.assert_array_equal(exact_neighbours(g, 4, rows, chunk=chunk).numpy(),
                                      _loop_neighbours(g.double().numpy(), 4)[rows])


def test_smooth_matches_the_rule_written_out():
    g = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    cfg = Smoothing(k=3, weight=2.5, rounds=2)
    want = g.double().numpy()
    for _ in range(2):
        nb = _loop_neighbours(want, 3)
        want = (want + 2.5 * want[nb].mean(1)) / 3.5
    np.testing.assert_allclose(smooth(g, cfg).numpy(), want, rtol=1e-5, atol=1e-6)


def test_smooth_acts_on_each_coordinate_alike():
    # a permutation of the modes commutes with smoothing (neighbours are by cosine, which
    # a permutation keeps), so coordinate i of the result is built from coordinate i only
    g = torch.randn(30, 8, generator=torch.Generator().manual_seed(2))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    cfg = Smoothing(k=4, weight=1.0, rounds=2)
    torch.testing.assert_close(smooth(g[:, perm], cfg), smooth(g, cfg)[:, perm])


def test_off_and_tiny_galleries_are_unchanged():
    g = torch.randn(5, 3)
    torch.testing.assert_close(smooth(g, Smoothing(k=0)), g)
    torch.testing.assert_close(smooth(g, Smoothing(k=3, weight=0.0)), g)
    torch.testing.assert_close(smooth(g[:1], Smoothing(k=10)), g[:1])
    # k larger than the gallery: every other photo is a neighbour
    out = smooth(g[:3], Smoothing(k=10, weight=1.0, rounds=1))
    others = torch.stack([g[[1, 2]].mean(0), g[[0, 2]].mean(0), g[[0, 1]].mean(0)])
    torch.testing.assert_close(out, (g[:3] + others) / 2)


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="-1"):
        Smoothing(k=-1)
    with pytest.raises(ValueError, match="weight"):
        Smoothing(weight=-0.5)
    with pytest.raises(ValueError, match="rounds"):
        Smoothing(rounds=0)


def test_a_bad_neighbour_search_is_refused():
    with pytest.raises(ValueError, match="expected"):
        smooth(torch.randn(6, 2), Smoothing(k=2), lambda g, k, r: torch.zeros(6, 1, dtype=int))


def test_smoothing_some_rows_holds_the_others_fixed():
    g = torch.randn(25, 4, generator=torch.Generator().manual_seed(5))
    cfg = Smoothing(k=3, weight=2.0, rounds=2)
    rows = torch.tensor([20, 21, 22, 23, 24])
    out = smooth(g, cfg, rows=rows)
    torch.testing.assert_close(out[:20], g[:20])
    want = g.double().numpy().copy()
    for _ in range(2):
        nb = _loop_neighbours(want, 3)[rows]
        want[rows] = (want[rows] + 2.0 * want[nb].mean(1)) / 3.0
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


def clustered(seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(queries, photos, labels): photos of 8 classes scattered around their class centre,
    queries of the same classes noisier."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(8, 16, generator=gen) * 2
    labels = np.repeat(np.arange(8), 12)
    g = centres[labels] + 1.5 * torch.randn(96, 16, generator=gen)
    f = centres[labels] + 3.0 * torch.randn(96, 16, generator=gen)
    return f, g, labels


def test_smoothing_raises_map_on_a_clustered_gallery():
    # averaging each photo with its same-class neighbours moves it toward the centre the
    # queries point at
    f, g, labels = clustered(4)
    plain = retrieval_metrics(f, g, labels, labels, 10)["map_all"]
    sm = smoothed_metrics(f, g, labels, labels, 10, Smoothing(k=5, weight=4.0, rounds=2))
    assert sm["map_all"] > plain + 0.05
    assert sm["config"] == {"k": 5, "weight": 4.0, "rounds": 2}
    assert set(sm["map_by_dims"]) == {"1", "2", "4", "8", "16"}
    assert sm["map_by_dims"]["16"] == sm["map_all"]
    # d modes: the prefixes of the gallery smoothed with all 16 modes
    g16 = smooth(g, Smoothing(k=5, weight=4.0, rounds=2))
    for d in (1, 4):
        want = retrieval_metrics(f[:, :d], g16[:, :d], labels, labels, 10)
        assert sm["map_by_dims"][str(d)] == pytest.approx(want["map_all"])
        assert sm["precision_by_dims"][str(d)] == pytest.approx(want["precision_at_k"])
    assert smoothed_metrics(f, g, labels, labels, 10, Smoothing(k=0)) is None


def test_expansion_matches_the_rule_written_out():
    gen = torch.Generator().manual_seed(5)
    f, g = torch.randn(9, 6, generator=gen), torch.randn(25, 6, generator=gen)
    cfg = Expansion(n=4, weight=0.7)
    want = []
    for q in f.double().numpy():
        best = sorted(range(25), key=lambda j: (-(q @ g.double().numpy()[j]), j))[:4]
        want.append(q + 0.7 * g.double().numpy()[best].mean(0))
    np.testing.assert_allclose(expand_exact(f, g, cfg).numpy(), np.array(want), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(expand_exact(f, g, Expansion(n=0)), f)
    torch.testing.assert_close(expand_exact(f, g, Expansion(n=3, weight=0.0)), f)
    # n beyond the gallery: all of it
    torch.testing.assert_close(expand_exact(f, g[:2], Expansion(n=10, weight=1.0)),
                               f + g[:2].mean(0))


def _brute_search(g: np.ndarray):
    """search(queries, k) by exact inner product over g (ties by row), as GalleryIndex's."""
    def search(q, k):
        s = q @ g[:, : q.shape[1]].T
        rows = np.argsort(-s, axis=1, kind="stable")[:, : min(k, len(g))]
        return np.take_along_axis(s, rows, 1).astype(np.float32), rows.astype(np.int64)
    return search


def _brute_pool(g: np.ndarray):
    """pool(queries, count) as Kind.pool's default gives it: the top count by exact search,
    their vectors on the queries' d, the queries as they are."""
    search = _brute_search(g)

    def pool(q, count):
        rows = search(q, count)[1]
        return rows, [g[r[r >= 0], : q.shape[1]] for r in rows], q
    return pool


def test_expanded_search_against_brute_force():
    """The service's search: rescore 0 is the expanded query's full search; rescore > 0
    is the expanded query's top k among the first search's best K = max(100, rescore x k),
    which is the full search's top k when K covers the gallery, and on a large clustered
    gallery agrees with it on the top 10."""
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(40, 12)) * 2
    g = (centres[rng.integers(0, 40, 4000)] + rng.normal(size=(4000, 12))).astype(np.float32)
    q = (centres[rng.integers(0, 40, 30)] + 2 * rng.normal(size=(30, 12))).astype(np.float32)
    search, vectors, cfg = _brute_search(g), (lambda rows, d: g[rows]), Expansion(n=5, weight=0.5)
    d = 8
    qd = np.ascontiguousarray(q[:, :d])
    first = np.argsort(-(qd @ g[:, :d].T), axis=1, kind="stable")
    expanded = qd + 0.5 * g[first[:, :5], :d].mean(1)
    full_scores = expanded @ g[:, :d].T  # (30, 4000)
    full = np.argsort(-full_scores, axis=1, kind="stable")
    pool = _brute_pool(g)
    s0, r0 = expanded_search(qd, 10, search, vectors, pool, cfg, rescore=0)
    np.testing.assert_array_equal(r0, full[:, :10])
    np.testing.assert_allclose(s0, np.take_along_axis(full_scores, full[:, :10], 1), rtol=1e-5)
    s, r = expanded_search(qd, 10, search, vectors, pool, cfg, rescore=10)  # K = 100
    for i in range(len(q)):
        cand = first[i, :100]
        want = cand[np.argsort(-full_scores[i, cand], kind="stable")[:10]]
        np.testing.assert_array_equal(r[i], want)
        np.testing.assert_allclose(s[i], full_scores[i, want], rtol=1e-5, atol=1e-5)
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(r, full[:, :10], strict=True)])
    assert overlap >= 0.95, overlap
    small = g[:80]  # K >= the gallery: the full search exactly
    _, rs = expanded_search(qd, 7, _brute_search(small), lambda rows, d: small[rows],
                            _brute_pool(small), cfg)
    want = np.argsort(-((qd + 0.5 * small[np.argsort(-(qd @ small[:, :d].T), axis=1,
                                                     kind="stable")[:, :5], :d].mean(1))
                         @ small[:, :d].T), axis=1, kind="stable")[:, :7]
    np.testing.assert_array_equal(rs, want)
    # off: the plain search
    np.testing.assert_array_equal(expanded_search(qd, 4, search, vectors, pool,
                                                  Expansion(n=0))[1],
                                  first[:, :4])


@pytest.mark.parametrize("bad", [{"n": -1}, {"n": 2.5}, {"weight": -0.1}])
def test_expansion_refuses_bad_settings(bad):
    with pytest.raises(ValueError, match="query expansion"):
        Expansion(**bad)


def test_service_metrics_expand_each_prefix_against_the_smoothed_gallery():
    f, g, labels = clustered(6)
    sm_cfg, ex_cfg = Smoothing(k=5, weight=4.0, rounds=2), Expansion(n=5, weight=0.5)
    off = service_metrics(f, g, labels, labels, 10, sm_cfg, Expansion(n=0))
    sm = smoothed_metrics(f, g, labels, labels, 10, sm_cfg)
    assert off["expansion"] == {} and off["smoothing"] == sm["config"]
    assert off["map_by_dims"] == sm["map_by_dims"] and off["map_all"] == sm["map_all"]
    on = service_metrics(f, g, labels, labels, 10, sm_cfg, ex_cfg)
    assert on["expansion"] == {"n": 5, "weight": 0.5}
    g16 = smooth(g, sm_cfg)
    for d in (2, 16):  # the query's d-prefix expanded with the gallery's d-prefixes
        want = retrieval_metrics(expand_exact(f[:, :d], g16[:, :d], ex_cfg), g16[:, :d],
                                 labels, labels, 10)
        assert on["map_by_dims"][str(d)] == pytest.approx(want["map_all"])
    assert on["map_all"] > off["map_all"]  # class neighbours pull the query to its class
    plain = service_metrics(f, g, labels, labels, 10, Smoothing(k=0), Expansion(n=0))
    assert plain["map_all"] == pytest.approx(retrieval_metrics(f, g, labels, labels,
                                                               10)["map_all"])
