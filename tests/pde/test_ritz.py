"""The Rayleigh-Ritz step against the analytic eigenfunctions: mixed exact eigenfunctions,
whose span is exact but whose own Rayleigh quotients are far off, are unmixed from samples
of p_train alone."""

import pytest
import torch
from torch import nn

from training.pde.evaluate import evaluate
from training.pde.problems import make_problem
from training.pde.ritz import ritz_rotation


class _MixedTruth(nn.Module):
    """psi / sqrt(w) of the true modes, scaled by sqrt(lambda), then mixed by ``mix``."""

    def __init__(self, problem, mix):
        super().__init__()
        self.problem, self.n_modes = problem, problem.n_eval
        self.register_buffer("scale", torch.tensor(problem.eigenvalues_true).sqrt())
        self.register_buffer("mix", mix)

    def forward(self, x):
        psi = self.problem.eigenfunctions(x)
        own = self.scale * psi * torch.exp(-0.5 * self.problem.log_weight(x)).unsqueeze(-1)
        return own @ self.mix.to(x.dtype)


@pytest.mark.parametrize("name", ["hydrogen", "oscillator"])
def test_ritz_unmixes_an_exact_span(name):
    problem = make_problem(name)
    n = problem.n_eval
    gen = torch.Generator().manual_seed(0)
    mix = torch.eye(n, dtype=torch.float64) + 0.3 * torch.randn(n, n, generator=gen,
                                                               dtype=torch.float64)
    model = _MixedTruth(problem, mix).double()
    plain = evaluate(model, problem)["metrics"]
    assert plain["rel_error_mean"] > 0.1  # each mixed mode's own quotient is far off
    assert plain["subspace_distance_mean"] > 1e-3
    values, C = ritz_rotation(model, problem, 16384, seed=1)
    assert C.shape == (n, n)
    truth = torch.tensor(problem.eigenvalues_true, dtype=torch.float64)
    # Monte Carlo estimates of G and A (A symmetrised): the Ritz values within 1%, and the
    # unmixed functions, measured on the quadrature, within 0.2% on average
    torch.testing.assert_close(values, truth, rtol=0.01, atol=0)
    refined = evaluate(model, problem, ritz=C)["ritz"]
    assert refined["rel_error_mean"] < 2e-3 and max(refined["rel_errors"]) < 0.01
    assert refined["order_correct"]
    assert refined["orthogonality"] < 1e-3
    assert refined["subspace_distance_mean"] < 2e-3


def test_ritz_directions_without_a_function_are_dropped():
    problem = make_problem("hydrogen")
    n = problem.n_eval
    mix = torch.eye(n, dtype=torch.float64)
    mix[:, -1] = 0  # the last output is identically zero
    values, C = ritz_rotation(_MixedTruth(problem, mix).double(), problem, 2048, seed=0)
    assert C.shape == (n, n - 1) and values.shape == (n - 1,)
    with pytest.raises(ValueError, match="n_samples"):
        ritz_rotation(_MixedTruth(problem, mix), problem, 1, seed=0)
