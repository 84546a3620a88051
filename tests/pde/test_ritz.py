"""The Rayleigh-Ritz step against the analytic eigenfunctions: mixed exact eigenfunctions,
whose span is exact but whose own Rayleigh quotients are far off, are unmixed from samples
of p_train alone."""

import pytest
import torch
from torch import nn

from training.pde.evaluate import evaluate
from training.pde.problems import make_problem
from training.pde.ritz import nested_modes, ritz_rotation


class _MixedTruth(nn.Module):
    """psi / sqrt(w) of the true modes, scaled by sqrt(lambda), then mixed by ``mix``.
    ``states``: the problem that provides the eigenfunctions psi (default: the problem
    itself) and ``scale`` their factors, for modes beyond the problem's positive ones."""

    def __init__(self, problem, mix, states=None, scale=None):
        super().__init__()
        self.problem, self.states = problem, states or problem
        self.modes = mix.shape[1]
        if scale is None:
            scale = torch.tensor(problem.eigenvalues_true).sqrt()
        self.register_buffer("scale", scale)
        self.register_buffer("mix", mix)

    def forward(self, x):
        psi = self.states.eigenfunctions(x)
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


def test_nested_modes_zero_the_surplus_and_keep_the_levels():
    # The 2D oscillator (c = 16: 28 positive modes) learned with surplus modes: the true
    # positive modes at norm lambda, the 9 states of level n = 8 (eigenvalue -2) at squared
    # norm 0.01-0.04, all mixed. The nested Ritz modes put the positive modes back at their
    # eigenvalues, as norms too, and every surplus direction at norm 0.
    problem = make_problem("oscillator")
    wide = make_problem("oscillator", shift=20.0)  # its positive states run to level n = 8
    n, m = problem.n_eval, wide.n_eval
    assert (n, m) == (28, 45)
    gen = torch.Generator().manual_seed(0)
    scale = torch.cat([torch.tensor(problem.eigenvalues_true).sqrt(), torch.zeros(m - n)])
    scale[36:] = 0.1 + 0.1 * torch.rand(m - 36, generator=gen, dtype=torch.float64)  # n = 8
    keep = torch.cat([torch.arange(n), torch.arange(36, m)])  # no zero level (n = 7)
    mix = torch.eye(len(keep), dtype=torch.float64) + 0.05 * torch.randn(
        len(keep), len(keep), generator=gen, dtype=torch.float64)
    full = torch.zeros(m, len(keep), dtype=torch.float64)
    full[keep] = mix
    model = _MixedTruth(problem, full, states=wide, scale=scale).double()
    plain = evaluate(model, problem)["metrics"]
    assert max(plain["eigenvalues_norm"][n:]) > 0.05  # surplus norms well above 0.01
    values, C = ritz_rotation(model, problem, 32768, seed=1)
    assert (values[:n] > 1.5).all() and (values[n:] < -1.5).all()
    refined = evaluate(model, problem, ritz=nested_modes(values, C))["ritz"]
    assert refined["order_correct"] and refined["rel_error_mean"] < 5e-3
    # the norms store the eigenvalues, to the Monte Carlo error of G and A (32K samples)
    norm_errors = torch.tensor(refined["rel_errors_norm"])
    assert norm_errors.mean() < 0.02 and norm_errors.max() < 0.05
    assert refined["eigenvalues_norm"][n:] == [0.0] * (len(keep) - n)
    with pytest.raises(ValueError, match="does not match"):
        nested_modes(values[:-1], C)
