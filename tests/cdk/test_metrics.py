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
