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


def test_the_grid_is_the_problems_and_refuses_what_does_not_fit():
    assert make_problem("hydrogen").grid == (80.0, 400)
    assert make_problem("oscillator").grid == (6.0, 120)
    with pytest.raises(ValueError, match="'oscillator' in 3D carries no grid solver"):
        solve_grid(make_problem("oscillator", 3))
    with pytest.raises(ValueError, match="2.89e\\+11 points"):
        grid_operator(make_problem("oscillator", 10), 6.0, 14)


def test_grid_solver_in_1d_and_3d_with_the_kinetic_coefficient():
    """H = -1/2 d^2/dx^2 + x^2/2 (energies n + 1/2) in 1D, and the 3D oscillator's top
    levels on a coarse box: the operator is assembled per axis for any dimension."""
    from training.pde.schrodinger import schrodinger

    one = schrodinger(lambda x: 0.5 * (x**2).sum(-1), 1, kinetic=0.5, shift=5.0,
                      energies=[0.5, 1.5, 2.5])
    r = solve_grid(one, half_width=8.0, n=400)
    assert r["rel_error_mean"] < 5e-4 and r["order_correct"]
    three = solve_grid(make_problem("oscillator", 3), half_width=4.0, n=20)
    assert three["order_correct"] and three["rel_error_mean"] < 0.06  # h = 0.4
    assert three["subspace_distance_mean"] < 0.01
