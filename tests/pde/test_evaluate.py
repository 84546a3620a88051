"""The evaluation pipeline scores the exact eigenfunctions, fed in the network's
importance-weighted form, as (nearly) perfect."""

import pytest
import torch
from torch import nn

from training.pde.evaluate import evaluate
from training.pde.problems import make_problem


class _ScaledTruth(nn.Module):
    """sqrt(lambda) psi / sqrt(w): what NestedLoRA should learn, shaped like the network."""

    def __init__(self, problem):
        super().__init__()
        self.problem, self.modes = problem, problem.n_eval
        self.scale = nn.Parameter(torch.tensor(problem.eigenvalues_true).sqrt())

    def forward(self, x):
        psi = self.problem.eigenfunctions(x)
        return self.scale * psi * torch.exp(-0.5 * self.problem.log_weight(x)).unsqueeze(-1)


@pytest.mark.parametrize("name,tol", [("hydrogen", 2e-3), ("oscillator", 1e-4)])
def test_exact_eigenfunctions_score_near_zero(name, tol):
    problem = make_problem(name)
    m = evaluate(_ScaledTruth(problem).double(), problem)["metrics"]
    assert m["rel_error_mean"] < tol  # finite differences, O(eps^2) (and the cusp at r=0)
    assert max(m["rel_errors_norm"]) < 1e-4  # norms: quadrature only
    assert m["subspace_distance_mean"] < 1e-8
    assert m["angle_distance_mean"] < 1e-3
    assert m["orthogonality"] < 1e-9
    assert m["order_correct"]


def test_aligned_functions_are_the_truth_for_the_truth_in_any_chunks():
    """The scaled exact eigenfunctions, aligned, are the eigenfunctions themselves (up to
    the finite-difference-free evaluation: exactly), evaluated a chunk at a time."""
    from training.pde.evaluate import aligned_functions

    problem = make_problem("hydrogen")
    model = _ScaledTruth(problem).double()
    result = evaluate(model, problem)
    rotations, norms = result["alignment"]["trained"]
    x = 5 * torch.randn(300, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    whole = aligned_functions(model, problem, rotations, norms)(x)
    torch.testing.assert_close(aligned_functions(model, problem, rotations, norms, chunk=7)(x),
                               whole, rtol=0, atol=0)
    torch.testing.assert_close(whole, problem.eigenfunctions(x), rtol=1e-4, atol=1e-6)
