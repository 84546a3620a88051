"""Every measure is zero on the ground truth and right on known rotations and
perturbations, computed on the hydrogen quadrature with the exact eigenfunctions."""

import math

import pytest
import torch

from training.pde import metrics
from training.pde.problems import make_problem


@pytest.fixture(scope="module")
def truth():
    p = make_problem("hydrogen")
    x, w = p.quadrature("cpu")
    psi = p.eigenfunctions(x)  # (N, 16), orthonormal to ~1e-5
    # re-orthonormalise exactly under w so the expected values below are exact
    chol = torch.linalg.cholesky(metrics.inner(psi, psi, w))
    psi = torch.linalg.solve_triangular(chol, psi.T, upper=False).T
    lam = torch.tensor(p.eigenvalues_true, dtype=torch.float64)
    return psi, w, lam, p.eigenvalues_true


def _summary(f, Tf, t):
    psi, w, lam, ev = t
    return metrics.summarize(f, Tf, psi, w, ev)


def test_all_measures_vanish_on_the_truth_scaled_like_nestedlora(truth):
    psi, w, lam, ev = truth
    f = psi * lam.sqrt()  # NestedLoRA's minimiser: eigenfunctions scaled by sqrt(lambda)
    s = _summary(f, f * lam, truth)
    assert s["rel_error_mean"] < 1e-12
    assert max(s["rel_errors_norm"]) < 1e-12
    assert s["subspace_distance_mean"] < 1e-12
    assert s["angle_distance_mean"] < 1e-6  # arccos is steep at 1
    assert s["orthogonality"] < 1e-24
    assert s["order_correct"] and s["modes_in_right_level"] == 16


def test_swapped_levels_are_reported_out_of_order(truth):
    psi, w, lam, ev = truth
    f = psi.clone()
    f[:, [0, 1]] = psi[:, [1, 0]]  # the ground state learned second
    Tf = f * lam[[1, 0] + list(range(2, 16))]
    s = _summary(f, Tf, truth)
    assert not s["order_correct"] and s["modes_in_right_level"] == 14
    assert metrics.level_assignment([1.0, 0.05, 0.022, -1.0], [1.0, 1 / 25, 1 / 49]) == [0, 1, 2, 2]


def test_rotation_inside_a_degenerate_subspace_changes_nothing(truth):
    psi, w, lam, ev = truth
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(7, 7, generator=gen, dtype=torch.float64))
    f = psi.clone()
    f[:, 9:16] = psi[:, 9:16] @ q  # the n = 3 subspace, rotated; Tf = lambda f there
    s = _summary(f, f * lam, truth)
    assert s["rel_error_mean"] < 1e-12
    assert s["subspace_distance_mean"] < 1e-12
    assert s["angle_distance_mean"] < 1e-6
    assert s["orthogonality"] < 1e-24
    # without the Procrustes step the angles would not vanish
    raw = metrics.angle_distances(f, psi, w)
    assert raw[9:].max() > 0.05


def test_mixing_two_subspaces_by_a_known_angle(truth):
    psi, w, lam, ev = truth
    theta = 0.3
    c, s_ = math.cos(theta), math.sin(theta)
    f = psi.clone()
    f[:, 0] = c * psi[:, 0] + s_ * psi[:, 1]
    f[:, 1] = -s_ * psi[:, 0] + c * psi[:, 1]
    Tf = psi * lam
    Tf[:, 0] = c * lam[0] * psi[:, 0] + s_ * lam[1] * psi[:, 1]
    Tf[:, 1] = -s_ * lam[0] * psi[:, 0] + c * lam[1] * psi[:, 1]
    out = _summary(f, Tf, truth)
    rq0 = c**2 * lam[0] + s_**2 * lam[1]
    assert out["eigenvalues"][0] == pytest.approx(rq0.item(), rel=1e-10)
    assert out["rel_errors"][0] == pytest.approx(abs(rq0.item() - 1.0), rel=1e-10)
    # subspace {0}: 1 - cos^2; subspace {1, 2, 3} loses sin^2 of one of three directions
    sub = out["subspace_distances"]
    assert sub[0] == pytest.approx(s_**2, rel=1e-9)
    assert sub[1] == pytest.approx(s_**2 / 3, rel=1e-9)
    assert sub[2] == pytest.approx(0, abs=1e-12) and sub[3] == pytest.approx(0, abs=1e-12)
    assert out["subspace_distance_mean"] == pytest.approx((s_**2 + s_**2 / 3) / 4, rel=1e-9)
    assert out["angle_distances"][0] == pytest.approx(2 / math.pi * theta, rel=1e-8)
    assert out["orthogonality"] < 1e-24  # still orthonormal


def test_orthogonality_error_of_a_known_perturbation(truth):
    psi, w, lam, ev = truth
    eps = 0.2
    f = psi.clone()
    f[:, 5] = psi[:, 5] + eps * psi[:, 2]  # <normalised f5, f2> = eps / sqrt(1 + eps^2)
    L = f.shape[1]
    expected = 2 * eps**2 / (1 + eps**2) / L**2
    assert metrics.orthogonality_error(f, w).item() == pytest.approx(expected, rel=1e-9)
    # scaling a column does not change it: the measure is on normalised functions
    assert metrics.orthogonality_error(3 * f, w).item() == pytest.approx(expected, rel=1e-9)


def test_norm_eigenvalues_and_relative_errors(truth):
    psi, w, lam, ev = truth
    scale = torch.linspace(0.5, 2.0, 16, dtype=torch.float64)
    norms = metrics.norm_eigenvalues(psi * scale, w)
    torch.testing.assert_close(norms, scale**2)
    rel = metrics.relative_errors(lam * 1.1, lam)
    torch.testing.assert_close(rel, torch.full_like(lam, 0.1))
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.relative_errors(lam[:3], lam)


def test_degenerate_groups():
    assert metrics.degenerate_groups([1.0, 0.5, 0.5, 0.2]) == [[0], [1, 2], [3]]
    assert metrics.degenerate_groups([]) == []


def test_inner_rejects_mismatched_points(truth):
    psi, w, _, _ = truth
    with pytest.raises(ValueError, match="point counts differ"):
        metrics.inner(psi[:10], psi, w)
