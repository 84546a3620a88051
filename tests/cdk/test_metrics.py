import numpy as np
import pytest
import torch

from training.cdk.metrics import (
    cosine_scores_metrics,
    orthogonality_stats,
    pca_curves,
    power_of_two_dims,
    retrieval_metrics,
    structure_curves,
)


def brute_force(scores, q_labels, g_labels, k):
    """Paper definitions, literally: AP = sum_n P(n) (R(n) - R(n-1)); ties by index."""
    aps, pks = [], []
    for q in range(scores.shape[0]):
        order = sorted(range(scores.shape[1]), key=lambda j: (-scores[q, j], j))
        rel = [g_labels[j] == q_labels[q] for j in order]
        total = sum(rel)
        ap, prev_recall = 0.0, 0.0
        for n in range(1, len(rel) + 1):
            p_n = sum(rel[:n]) / n
            r_n = sum(rel[:n]) / total
            ap += p_n * (r_n - prev_recall)
            prev_recall = r_n
        aps.append(ap)
        pks.append(sum(rel[:k]) / k)
    return float(np.mean(aps)), float(np.mean(pks))


def test_hand_made_case():
    # One query of class 0; gallery ranked [rel, irr, rel, irr] by score.
    f = torch.tensor([[1.0]])
    g = torch.tensor([[4.0], [3.0], [2.0], [1.0]])
    m = retrieval_metrics(f, g, [0], [0, 1, 0, 1], k=2)
    assert m["map_all"] == pytest.approx((1 / 1 + 2 / 3) / 2)
    assert m["precision_at_k"] == pytest.approx(0.5) and m["k"] == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    f = rng.integers(-2, 3, size=(7, 3)).astype(float)  # small integers: many tied scores
    g = rng.integers(-2, 3, size=(11, 3)).astype(float)
    ql, gl = rng.integers(0, 3, 7), np.array([0, 1, 2] + list(rng.integers(0, 3, 8)))
    m = retrieval_metrics(f, g, ql, gl, k=4, chunk=3)
    ref_map, ref_pk = brute_force(f @ g.T, ql, gl, 4)
    assert m["map_all"] == pytest.approx(ref_map, abs=1e-12)
    assert m["precision_at_k"] == pytest.approx(ref_pk, abs=1e-12)


def test_prefix_convention_and_least_modes():
    rng = np.random.default_rng(3)
    f, g = torch.tensor(rng.normal(size=(9, 8))), torch.tensor(rng.normal(size=(10, 8)))
    ql, gl = rng.integers(0, 2, 9), np.array([0, 1] * 5)
    curves = structure_curves(f, g, ql, gl, k=3)
    assert sorted(curves["most"]) == [1, 2, 4, 8]
    # d most significant = plain inner product of the d-prefixes = zero-padded queries.
    padded = f.clone()
    padded[:, 4:] = 0
    assert curves["most"][4] == retrieval_metrics(padded, g, ql, gl, 3)
    ref = brute_force((f[:, -2:] @ g[:, -2:].T).numpy(), ql, gl, 3)
    assert curves["least"][2]["map_all"] == pytest.approx(ref[0])
    assert curves["most"][8] == curves["least"][8]


def test_cosine_baseline_and_errors():
    x = torch.tensor([[1.0, 0.0], [0.0, 5.0]])
    y = torch.tensor([[10.0, 0.5], [0.1, 1.0], [1.0, 1.0]])
    m = cosine_scores_metrics(x, y, [0, 1], [0, 1, 1], k=1)
    assert m["precision_at_k"] == 1.0
    with pytest.raises(ValueError, match="no photo"):
        retrieval_metrics(x, y, [0, 5], [0, 1, 1], k=1)


def test_pca_baseline_against_covariance_eigenvectors():
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.2])  # distinct variances: unique axes
    tx, ty = torch.randn(40, 6, generator=gen) * scale, torch.randn(30, 6, generator=gen) * scale
    x, y = torch.randn(12, 6, generator=gen), torch.randn(15, 6, generator=gen)
    ql, gl = [i % 3 for i in range(12)], [i % 3 for i in range(15)]
    both = pca_curves(tx, ty, x, y, ql, gl, 4, [1, 2, 4, 6, 8])
    curves, inner = both["cosine"], both["inner"]
    assert sorted(curves) == sorted(inner) == [1, 2, 4, 6]  # no more axes than feature dimensions
    pool = torch.cat([tx, ty]).double()
    mean = pool.mean(0)
    evals, evecs = torch.linalg.eigh(torch.cov(pool.T))  # ascending; sign is irrelevant
    for d in (1, 2, 4):
        axes = evecs[:, -d:]
        ref = cosine_scores_metrics((x - mean) @ axes, (y - mean) @ axes, ql, gl, 4)
        assert curves[d]["map_all"] == pytest.approx(ref["map_all"], abs=1e-12)
    # All axes: a rotation of the centred features, which cosine does not see.
    full = cosine_scores_metrics(x.double() - mean, y.double() - mean, ql, gl, 4)
    assert curves[6]["map_all"] == pytest.approx(full["map_all"], abs=1e-12)
    # Inner-product scoring: all axes give the centred features' own inner products.
    ref = retrieval_metrics((x - mean) @ evecs[:, -2:], (y - mean) @ evecs[:, -2:], ql, gl, 4)
    assert inner[2]["map_all"] == pytest.approx(ref["map_all"], abs=1e-12)
    full = retrieval_metrics(x.double() - mean, y.double() - mean, ql, gl, 4)
    assert inner[6]["map_all"] == pytest.approx(full["map_all"], abs=1e-12)


def test_power_of_two_dims():
    assert power_of_two_dims(8) == [1, 2, 4, 8]
    assert power_of_two_dims(12) == [1, 2, 4, 8, 12]
    assert power_of_two_dims(1) == [1]


def test_orthogonality_stats():
    q, _ = torch.linalg.qr(torch.randn(50, 4, dtype=torch.float64))
    q = q - q.mean(0)  # remove the constant direction, then re-orthogonalise
    q, _ = torch.linalg.qr(q)
    o = orthogonality_stats(q * torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64))
    assert o["max_abs_offdiag"] < 1e-10 and o["max_abs_mean_ratio"] < 1e-10
    z = torch.randn(200, 2, dtype=torch.float64)
    z[:, 1] = z[:, 0]
    assert orthogonality_stats(z)["max_abs_offdiag"] == pytest.approx(1.0)


def test_spectrum_order_against_a_loop():
    from training.cdk.metrics import spectrum_order

    rng = np.random.default_rng(3)
    for _ in range(20):
        sv = np.sort(rng.random(40))[::-1] + rng.normal(0, 0.02, 40)
        rises = [sv[i + 1] - sv[i] for i in range(31) if sv[i + 1] > sv[i]]
        got = spectrum_order(sv)
        assert got["top"] == 32 and got["rising_pairs"] == len(rises)
        assert got["max_swap"] == pytest.approx(max(rises, default=0.0))
    assert spectrum_order([3.0, 2.0, 1.0]) == {"top": 3, "max_swap": 0.0, "rising_pairs": 0}


def _loop_smooth(g: np.ndarray, k: int, weight: float, rounds: int) -> np.ndarray:
    """Gallery smoothing written out: each photo moves to (g + w mean of its k nearest by
    cosine, itself excluded, ties by index) / (1 + w), ``rounds`` times."""
    for _ in range(rounds):
        unit = g / np.linalg.norm(g, axis=1, keepdims=True)
        new = g.copy()
        for i in range(len(g)):
            near = sorted((j for j in range(len(g)) if j != i),
                          key=lambda j: (-(unit[i] @ unit[j]), j))[:k]
            new[i] = (g[i] + weight * g[near].mean(0)) / (1 + weight)
        g = new
    return g


def _loop_seen_share(scores: np.ndarray, seen: np.ndarray, k: int) -> float:
    shares = [np.mean([seen[j] for j in sorted(range(scores.shape[1]),
                                               key=lambda j: (-scores[q, j], j))[:k]])
              for q in range(scores.shape[0])]
    return float(np.mean(shares))


@pytest.mark.parametrize("seed", [0, 1])
def test_generalized_metrics_match_brute_force(seed):
    """Held-out queries against a gallery holding the training classes' photos too: the
    plain block, the learned prefix, and the service block (the whole gallery smoothed,
    each query expanded with its best photos), each against loops written out."""
    from training.cdk.metrics import generalized_metrics
    from training.cdk.model.smoothing import Expansion, Smoothing

    rng = np.random.default_rng(seed)
    f = rng.normal(size=(8, 6))
    g = rng.normal(size=(30, 6))
    gl = np.arange(30) % 6  # classes 0-3 trained (seen), 4-5 held out
    seen = gl < 4
    ql = rng.integers(4, 6, 8)
    sm, ex = Smoothing(k=3, weight=2.0, rounds=2), Expansion(n=2, weight=0.5)
    m = generalized_metrics(torch.tensor(f), torch.tensor(g), ql, gl, seen, 5, sm, ex,
                            learned=4)

    ref_map, ref_p = brute_force(f @ g.T, ql, gl, 5)
    assert m["map_all"] == pytest.approx(ref_map, abs=1e-12)
    assert m["precision_at_k"] == pytest.approx(ref_p, abs=1e-12)
    assert m["seen_at_k"] == pytest.approx(_loop_seen_share(f @ g.T, seen, 5), abs=1e-12)
    assert (m["gallery"], m["seen_photos"]) == (30, 20)

    lm = brute_force(f[:, :4] @ g[:, :4].T, ql, gl, 5)
    assert m["learned"]["map_all"] == pytest.approx(lm[0], abs=1e-12)
    assert m["learned"]["seen_at_k"] == pytest.approx(
        _loop_seen_share(f[:, :4] @ g[:, :4].T, seen, 5), abs=1e-12)

    gs = _loop_smooth(g, 3, 2.0, 2)
    s = f @ gs.T
    best = [sorted(range(30), key=lambda j: (-s[q, j], j))[:2] for q in range(8)]
    fx = np.stack([f[q] + 0.5 * gs[best[q]].mean(0) for q in range(8)])
    sv = m["service"]
    ref_map, ref_p = brute_force(fx @ gs.T, ql, gl, 5)
    assert sv["map_all"] == pytest.approx(ref_map, abs=1e-5)  # the gallery is float32
    assert sv["precision_at_k"] == pytest.approx(ref_p, abs=1e-5)
    assert sv["seen_at_k"] == pytest.approx(_loop_seen_share(fx @ gs.T, seen, 5), abs=1e-5)
    assert sv["seen_at_k_by_dims"]["6"] == sv["seen_at_k"]
    assert sv["expansion"] == {"n": 2, "weight": 0.5}


def test_generalized_metrics_count_seen_photos_in_the_top_k():
    # one query of class 1; the two photos of class 0 (seen) score highest
    from training.cdk.metrics import generalized_metrics
    from training.cdk.model.smoothing import Expansion, Smoothing

    f = torch.tensor([[1.0]])
    g = torch.tensor([[4.0], [3.0], [2.0], [1.0]])
    m = generalized_metrics(f, g, [1], [0, 0, 1, 1], [True, True, False, False], 2,
                            Smoothing(k=0), Expansion(n=0))
    assert m["seen_at_k"] == 1.0 and m["precision_at_k"] == 0.0
    assert m["map_all"] == pytest.approx((1 / 3 + 2 / 4) / 2)
    assert m["service"]["seen_at_k"] == 1.0 and m["learned"] is None
    with pytest.raises(ValueError, match="seen must be one bool per gallery photo"):
        generalized_metrics(f, g, [1], [0, 0, 1, 1], [True], 2, Smoothing(k=0),
                            Expansion(n=0))
