"""The finite-difference and autograd Laplacians agree with each other and with the
analytic eigen-equation, including through the importance weight; the step built on them
(T f a constant) gives every method the gradients of the full-graph computation."""

import pytest
import torch
from torch import nn

from training.pde.laplacian import exact_laplacian, fd_laplacian, negative_hamiltonian
from training.pde.methods import make_method
from training.pde.networks import DisjointMLPs
from training.pde.problems import make_problem


def _net(L=3, D=2, K=8, kappa=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return DisjointMLPs(L, D, K, kappa, hidden=16, generator=gen).double()


MIXTURE = dict(mix_std=2.0, mix_fraction=0.25)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mixture", [{}, MIXTURE])
def test_fd_and_exact_laplacian_agree_on_a_network_with_importance_weight(mixture, dtype):
    # float32 as in training: torch.logaddexp's second derivative was NaN there
    problem = make_problem("hydrogen", **mixture)
    net = _net().to(dtype)
    x = problem.sample(64, torch.Generator().manual_seed(1), "cpu", dtype)
    eps = 0.01
    f1, lap_fd = fd_laplacian(net, problem.log_weight, x, eps=eps)
    f2, lap_ex = exact_laplacian(net, problem.log_weight, x, net.modes)
    torch.testing.assert_close(f1, f2)
    assert torch.isfinite(lap_ex).all()
    if dtype == torch.float64:
        assert ((lap_fd - lap_ex).abs().max() / lap_ex.abs().max()) < 1e-4
        return
    # float32: the exact Laplacian is the float64 one of the same network at the same points
    # to float32 precision; the finite differences are off by their rounding, a few ulps of
    # |f| at each of the 2D + 1 stencil points divided by eps^2 (~0.03 here, ~20% of the
    # Laplacian, so only a bound of that form holds across CPUs)
    net64 = _net().double()
    _, lap_64 = exact_laplacian(net64, problem.log_weight, x.double(), net64.modes)
    assert ((lap_ex.double() - lap_64).abs().max() / lap_64.abs().max()) < 1e-4
    ulp = torch.finfo(dtype).eps
    rounding = 4 * (2 * x.shape[-1] + 1) * ulp * f1.abs().max() / eps**2
    assert (lap_fd - lap_ex).abs().max() < rounding


def test_exact_laplacian_of_a_quadratic():
    # f(x) = |x|^2 in 3D has Laplacian 6 everywhere; unit weight
    fn = lambda x: (x**2).sum(-1, keepdim=True) if x.dim() == 2 else (x**2).sum(-1).T  # noqa: E731
    x = torch.randn(10, 3, dtype=torch.float64)
    zero = lambda z: torch.zeros(z.shape[:-1], dtype=z.dtype)  # noqa: E731
    _, lap = exact_laplacian(fn, zero, x, modes=1)
    torch.testing.assert_close(lap, torch.full_like(lap, 6.0))
    _, lap_fd = fd_laplacian(fn, zero, x, eps=0.01)
    torch.testing.assert_close(lap_fd, torch.full_like(lap, 6.0))


class _Analytic(nn.Module):
    """psi / sqrt(w): the importance-weighted form of the exact eigenfunctions, shaped
    like the network (per-mode inputs (L, B, D) -> (B, L) as well)."""

    def __init__(self, problem):
        super().__init__()
        self.problem, self.modes = problem, problem.n_eval

    def forward(self, x):
        if x.dim() == 2:
            psi = self.problem.eigenfunctions(x)
            return psi * torch.exp(-0.5 * self.problem.log_weight(x)).unsqueeze(-1)
        cols = [self.forward(x[l])[:, l] for l in range(x.shape[0])]
        return torch.stack(cols, -1)


def test_operator_maps_weighted_eigenfunctions_to_eigenvalue_times_themselves():
    for name, mixture in [("hydrogen", {}), ("oscillator", {}), ("hydrogen", MIXTURE)]:
        problem = make_problem(name, **mixture)
        model = _Analytic(problem)
        gen = torch.Generator().manual_seed(2)
        x = 2 + 3 * torch.rand(32, 2, generator=gen, dtype=torch.float64)  # off the origin
        lam = torch.tensor(problem.eigenvalues_true, dtype=torch.float64)
        for lap in ("fd", "exact"):
            ft, Tft = negative_hamiltonian(model, problem, x, lap, 0.01)
            err = (Tft - lam * ft).abs().max() / (lam * ft).abs().max()
            assert err < (1e-3 if lap == "fd" else 1e-8), (name, lap, err)


# ------------------------------------------------ the step against the full-graph one


def _full_graph_hamiltonian(model, problem, x, laplacian, eps=0.01):
    """The computation the step used before T f became a constant: every stencil point
    (fd) or a second-order graph (exact) tracked by autograd, T f carrying that graph."""
    B, D = x.shape
    if laplacian == "fd":
        shifts = torch.zeros(2 * D + 1, D, dtype=x.dtype)
        idx = torch.arange(D)
        shifts[1 + idx, idx] = eps
        shifts[1 + D + idx, idx] = -eps
        pts = (x.unsqueeze(0) + shifts.unsqueeze(1)).reshape(-1, D)  # centre first
        out = model(pts).reshape(2 * D + 1, B, -1)
        logw = problem.log_weight(pts).reshape(2 * D + 1, B)
        ratio = torch.exp(0.5 * (logw[1:] - logw[:1])).unsqueeze(-1)
        ft, lap = out[0], ((ratio * out[1:]).sum(0) - 2 * D * out[0]) / eps**2
    else:
        xr = x.unsqueeze(0).expand(model.modes, -1, -1).clone().requires_grad_(True)
        ft = model(xr)
        f = ft * torch.exp(0.5 * problem.log_weight(xr)).T
        (grad,) = torch.autograd.grad(f.sum(), xr, create_graph=True)
        lap = sum(
            torch.autograd.grad(grad[..., i].sum(), xr, create_graph=True)[0][..., i].T
            for i in range(D)
        )
        lap = lap * torch.exp(-0.5 * problem.log_weight(x)).unsqueeze(-1)
    return ft, lap + (problem.shift - problem.potential(x)).unsqueeze(-1) * ft


@pytest.mark.parametrize("laplacian", ["fd", "exact"])
@pytest.mark.parametrize("method", ["neuralsvd-seq", "neuralsvd-jnt", "neuralef", "spin"])
def test_step_gradients_equal_those_of_the_full_graph(method, laplacian):
    problem = make_problem("hydrogen")
    net = _net(L=4, K=8, kappa=0.5)
    params = list(net.parameters())
    x = problem.sample(32, torch.Generator().manual_seed(3), "cpu", torch.float64)
    config = type("C", (), {"spin_decay": 0.9})()
    results = []
    for hamiltonian in (negative_hamiltonian, _full_graph_hamiltonian):
        ft, Tft = hamiltonian(net, problem, x, laplacian, 0.01)
        loss, eigs = make_method(method, 4, config)(ft, Tft, params)
        results.append((Tft.detach(), loss, eigs, torch.autograd.grad(loss, params)))
    (Tft, loss, eigs, grads), (Tft_ref, loss_ref, eigs_ref, grads_ref) = results
    scale = Tft_ref.abs().max()
    torch.testing.assert_close(Tft, Tft_ref, rtol=1e-9, atol=1e-9 * scale)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-9, atol=0)
    torch.testing.assert_close(eigs, eigs_ref, rtol=1e-9, atol=0)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9 * r.abs().max())
    assert all(r.abs().max() > 0 for r in grads_ref)


@pytest.mark.parametrize("laplacian", ["fd", "exact"])
def test_only_the_functions_carry_a_graph(laplacian):
    problem = make_problem("hydrogen")
    net = _net()
    x = problem.sample(8, torch.Generator().manual_seed(4), "cpu", torch.float64)
    ft, Tft = negative_hamiltonian(net, problem, x, laplacian, 0.01)
    assert ft.requires_grad and not Tft.requires_grad


@pytest.mark.parametrize("name,ndim,mixture", [("hydrogen", None, MIXTURE),
                                               ("oscillator", 10, {}), ("hydrogen-3d", None, {})])
def test_the_forward_laplacian_is_autograds_exactly(name, ndim, mixture):
    """Value, gradient and Laplacian of the network in one forward pass, and the
    operator built on them, against autograd's in float64 (chunks of 1 and 2 modes too)."""
    from training.pde.laplacian import forward_laplacian

    problem = make_problem(name, ndim, **mixture)
    D = problem.ndim
    net = _net(L=5, D=D, kappa=0.3)
    x = problem.sample(40, torch.Generator().manual_seed(2), "cpu", torch.float64)
    centre, lap = forward_laplacian(net, problem.log_weight, x)
    _, ref = exact_laplacian(net, problem.log_weight, x, net.modes)
    torch.testing.assert_close(lap, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(centre, net(x), rtol=0, atol=0)
    assert centre.requires_grad and not lap.requires_grad
    # the network's own derivatives, against autograd per mode
    xr = x.unsqueeze(0).expand(5, -1, -1).clone().requires_grad_(True)
    (g,) = torch.autograd.grad(net(xr).sum(), xr)  # (L, B, D)
    for m in (None, 1, 2):
        _, grad, lap_t = net.derivatives(x, modes_per_product=m)
        torch.testing.assert_close(grad, g.permute(2, 1, 0), rtol=1e-10, atol=1e-12)
    zero = lambda z: torch.zeros(z.shape[:-1], dtype=z.dtype)  # noqa: E731
    torch.testing.assert_close(lap_t, exact_laplacian(net, zero, x, 5)[1], rtol=1e-10,
                               atol=1e-12)
    # and in training's form: the same parameter gradients as through the fd stencil
    ft, Tft = negative_hamiltonian(net, problem, x, "forward")
    ft_fd, Tft_fd = negative_hamiltonian(net, problem, x, "fd", 1e-4)
    torch.testing.assert_close(Tft, Tft_fd, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ft, ft_fd, rtol=0, atol=0)
