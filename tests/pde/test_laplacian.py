"""The finite-difference and autograd Laplacians agree with each other and with the
analytic eigen-equation, including through the importance weight."""

import torch
from torch import nn

from training.pde.laplacian import exact_laplacian, fd_laplacian, negative_hamiltonian
from training.pde.networks import DisjointMLPs
from training.pde.problems import make_problem


def _net(L=3, D=2, K=8, kappa=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return DisjointMLPs(L, D, K, kappa, hidden=16, generator=gen).double()


def test_fd_and_exact_laplacian_agree_on_a_network_with_importance_weight():
    problem = make_problem("hydrogen")
    net = _net()
    x = 16 * torch.randn(64, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    f1, lap_fd = fd_laplacian(net, problem.log_weight, x, eps=0.01)
    f2, lap_ex = exact_laplacian(net, problem.log_weight, x, net.n_modes, create_graph=False)
    torch.testing.assert_close(f1, f2)
    assert ((lap_fd - lap_ex).abs().max() / lap_ex.abs().max()) < 1e-4


def test_exact_laplacian_of_a_quadratic():
    # f(x) = |x|^2 in 3D has Laplacian 6 everywhere; unit weight
    fn = lambda x: (x**2).sum(-1, keepdim=True) if x.dim() == 2 else (x**2).sum(-1).T  # noqa: E731
    x = torch.randn(10, 3, dtype=torch.float64)
    zero = lambda z: torch.zeros(z.shape[:-1], dtype=z.dtype)  # noqa: E731
    _, lap = exact_laplacian(fn, zero, x, n_modes=1, create_graph=False)
    torch.testing.assert_close(lap, torch.full_like(lap, 6.0))
    _, lap_fd = fd_laplacian(fn, zero, x, eps=0.01)
    torch.testing.assert_close(lap_fd, torch.full_like(lap, 6.0))


class _Analytic(nn.Module):
    """psi / sqrt(w): the importance-weighted form of the exact eigenfunctions, shaped
    like the network (per-mode inputs (L, B, D) -> (B, L) as well)."""

    def __init__(self, problem):
        super().__init__()
        self.problem, self.n_modes = problem, problem.n_eval

    def forward(self, x):
        if x.dim() == 2:
            psi = self.problem.eigenfunctions(x)
            return psi * torch.exp(-0.5 * self.problem.log_weight(x)).unsqueeze(-1)
        cols = [self.forward(x[l])[:, l] for l in range(x.shape[0])]
        return torch.stack(cols, -1)


def test_operator_maps_weighted_eigenfunctions_to_eigenvalue_times_themselves():
    for name in ("hydrogen", "oscillator"):
        problem = make_problem(name)
        model = _Analytic(problem)
        gen = torch.Generator().manual_seed(2)
        x = 2 + 3 * torch.rand(32, 2, generator=gen, dtype=torch.float64)  # off the origin
        lam = torch.tensor(problem.eigenvalues_true, dtype=torch.float64)
        for lap in ("fd", "exact"):
            ft, Tft = negative_hamiltonian(model, problem, x, lap, 0.01, create_graph=False)
            err = (Tft - lam * ft).abs().max() / (lam * ft).abs().max()
            assert err < (1e-3 if lap == "fd" else 1e-8), (name, lap, err)
