"""The classical cross-check converges to the analytic spectrum on a small grid."""

import pytest
import torch

from training.pde.grid import grid_operator, solve_grid
from training.pde.problems import make_problem


def test_grid_solver_recovers_the_oscillator_to_second_order():
    problem = make_problem("oscillator")
    coarse = solve_grid(problem, half_width=6.0, n=60)
    fine = solve_grid(problem, half_width=6.0, n=120)
    assert fine["rel_error_mean"] < 0.01
    assert fine["subspace_distance_mean"] < 1e-3
    assert fine["orthogonality"] < 1e-20  # eigsh returns orthonormal vectors
    # O(h^2): halving h cuts the eigenvalue error about four times
    ratio = coarse["rel_error_mean"] / fine["rel_error_mean"]
    assert 3 < ratio < 5


def test_grid_operator_is_symmetric_and_avoids_the_origin():
    T, x, h = grid_operator(make_problem("hydrogen"), 10.0, 20)
    assert abs(T - T.T).max() == 0
    assert x.norm(dim=-1).min() == pytest.approx(h / 2**0.5)
    assert torch.isfinite(torch.as_tensor(T.diagonal())).all()


def test_grid_solver_refuses_high_dimension():
    with pytest.raises(ValueError, match="2D problems only.*ndim=3"):
        solve_grid(make_problem("oscillator", 3))
