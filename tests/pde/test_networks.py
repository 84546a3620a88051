"""The batched disjoint MLPs equal L separate networks evaluated one by one; the Fourier
frequencies have standard deviation 2 pi kappa; the finite-difference stencil built from the
centres' features equals the network evaluated at the shifted points."""

import math

import pytest
import torch
from torch.nn import functional as F

from training.pde.networks import DisjointMLPs, softplus


def _reference(net, x, l):
    # mode l alone, written as a plain MLP with its slice of the stacked weights
    proj = x @ net.freq[l]
    h = torch.cat([torch.cos(proj), torch.sin(proj), x], -1)
    h = F.softplus(h @ net.w1[l] + net.b1[l])
    h = F.softplus(h @ net.w2[l] + net.b2[l])
    return (h @ net.w3[l] + net.b3[l]).squeeze(-1)


def test_batched_modes_equal_separate_networks_and_are_disjoint():
    gen = torch.Generator().manual_seed(0)
    net = DisjointMLPs(5, 2, 16, 0.5, 12, generator=gen).double()
    x = torch.randn(30, 2, generator=gen, dtype=torch.float64)
    out = net(x)
    assert out.shape == (30, 5)
    for l in range(5):
        torch.testing.assert_close(out[:, l], _reference(net, x, l))
    # per-mode inputs give the same values; mode 3's output ignores mode 1's parameters
    torch.testing.assert_close(net(x.expand(5, -1, -1)), out)
    out[:, 3].sum().backward()
    assert net.w1.grad[1].abs().max() == 0 and net.w1.grad[3].abs().max() > 0


def test_bad_inputs_are_errors():
    net = DisjointMLPs(3, 2, 4, 1.0, 8)
    with pytest.raises(ValueError, match=r"input must be \(B, 2\)"):
        net(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="hidden must be a positive integer, got 0"):
        DisjointMLPs(3, 2, 4, 1.0, 0)
    with pytest.raises(ValueError, match="fourier_scale must be positive"):
        DisjointMLPs(3, 2, 4, -1.0, 8)
    with pytest.raises(ValueError, match="x requires grad"):
        net.fd_stencil(torch.zeros(4, 2, requires_grad=True), 0.01)


def test_fourier_frequencies_have_std_two_pi_kappa():
    # kappa is read as in the paper's published code: B = 2 pi kappa randn, so the
    # standard deviation is 2 pi kappa (3.14 at kappa = 0.5), not sqrt(2 pi kappa) (1.77)
    net = DisjointMLPs(8, 2, 1000, 0.5, 4, generator=torch.Generator().manual_seed(0))
    assert net.freq.shape == (8, 2, 1000)
    assert abs(net.freq.std().item() / (2 * math.pi * 0.5) - 1) < 0.03  # 16,000 draws
    assert abs(net.freq.mean().item()) < 0.1


def _feature_fit_residual(kappa: float) -> torch.Tensor:
    # relative L2(p_train) residual of the best fit of the oscillator's targets
    # f~ = psi / sqrt(w) (the ground state and level 1) by one mode's K = 64 features
    from training.pde.problems import make_problem

    p = make_problem("oscillator")
    x = p.sample(4000, torch.Generator().manual_seed(1), "cpu", torch.float64)
    target = p.eigenfunctions(x)[:, :3] * torch.exp(-0.5 * p.log_weight(x)).unsqueeze(-1)
    net = DisjointMLPs(1, 2, 64, kappa, 4, generator=torch.Generator().manual_seed(0))
    proj = x @ net.freq[0].double()
    feat = torch.cat([torch.cos(proj), torch.sin(proj), x, torch.ones_like(x[:, :1])], -1)
    fit = feat @ torch.linalg.lstsq(feat, target).solution
    return (((fit - target) ** 2).mean(0) / (target**2).mean(0)).sqrt()


def test_oscillator_cpu_features_resolve_the_targets():
    # kappa = 1 (the paper's, with K = 256) leaves K = 64 features at frequencies ~6 that
    # cannot form the width-1 bump f~: the cpu run collapsed to zero. The cpu preset's
    # kappa = 0.15 resolves it.
    from training.pde.config import preset
    from training.pde.problems import make_problem

    kappa = preset("cpu", make_problem("oscillator")).fourier_scale
    assert _feature_fit_residual(kappa).max() < 0.45
    assert _feature_fit_residual(1.0).min() > 0.7
    # reading N(0, 2 pi kappa) as a variance instead (std sqrt(2 pi) ~ 2.5 at kappa = 1)
    # would not rescue these features either
    assert _feature_fit_residual(math.sqrt(2 * math.pi) / (2 * math.pi)).min() > 0.5


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_fd_stencil_equals_the_network_at_the_shifted_points(ndim):
    gen = torch.Generator().manual_seed(2)
    net = DisjointMLPs(4, ndim, 16, 0.5, 12, generator=gen).double()
    x = 3 * torch.randn(20, ndim, generator=gen, dtype=torch.float64)
    eps = 0.01
    shifts = eps * torch.cat([torch.eye(ndim), -torch.eye(ndim)]).double()  # (2D, D)
    expected = net((x + shifts.unsqueeze(1)).reshape(-1, ndim)).reshape(2 * ndim, 20, 4)
    for modes_per_product in (1, 3, 4):  # per mode (the CPU's default), in chunks, all
        centre, shifted = net.fd_stencil(x, eps, modes_per_product)
        assert shifted.shape == (2 * ndim, 20, 4) and not shifted.requires_grad
        torch.testing.assert_close(shifted, expected, rtol=1e-12, atol=1e-12)
    # the centre is the forward pass, with its graph
    torch.testing.assert_close(centre, net(x), rtol=0, atol=0)
    grads = torch.autograd.grad(centre.square().sum(), list(net.parameters()))
    grads_ref = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_bf16_stencil_keeps_the_differences_the_laplacian_uses(ndim):
    # The bf16 path rounds the first layer's feature products (centre, its weight gradient,
    # and the shifts, computed as differences from the centre). Against float64: the
    # centre and the parameter gradients within 1%, the first differences
    # f(x +- eps e_i) - f(x) within 1% (a bf16 f(x + eps e_i) itself would lose them
    # altogether), and the second differences, the Laplacian, no further off than fp32's
    # own (its cancellation dominates; the odd products' rounding cancels between
    # x + eps e_i and x - eps e_i).
    gen = torch.Generator().manual_seed(3)
    net = DisjointMLPs(5, ndim, 256, 0.2, 32, generator=gen)
    x = 4 * torch.randn(64, ndim, generator=gen)
    eps = 0.01

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    net.double()
    c64, s64 = net.fd_stencil(x.double(), eps)
    g64 = torch.autograd.grad(c64.square().sum(), list(net.parameters()))
    net.float()
    c32, s32 = net.fd_stencil(x, eps)
    d64 = s64 - c64.detach()
    second64 = d64[:ndim] + d64[ndim:]
    for modes_per_product in (None, 2, 5):
        cb, sb = net.fd_stencil(x, eps, modes_per_product, precision="bf16")
        assert sb.dtype == cb.dtype == torch.float32 and not sb.requires_grad
        assert rel(cb.detach(), c64.detach()) < 1e-2
        db = sb - cb.detach()
        assert rel(db, d64) < 1e-2
        err = {name: rel(d[:ndim] + d[ndim:], second64)
               for name, d in {"fp32": s32 - c32.detach(), "bf16": db}.items()}
        assert err["bf16"] <= 1.5 * err["fp32"] + 1e-3, err
        grads = torch.autograd.grad(cb.square().sum(), list(net.parameters()))
        for g, r in zip(grads, g64, strict=True):
            assert rel(g, r) < 1e-2
    with pytest.raises(ValueError, match="precision"):
        net.fd_stencil(x, eps, precision="fp16")
    with pytest.raises(ValueError, match="float32"):
        net.double().fd_stencil(x.double(), eps, precision="bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_stencil_on_cuda_keeps_the_differences():
    gen = torch.Generator().manual_seed(4)
    net = DisjointMLPs(16, 2, 1024, 0.1, 128, generator=gen)
    x = 16 * torch.randn(128, 2, generator=gen)
    c64, s64 = net.double().fd_stencil(x.double(), 0.01)
    net.float().cuda()
    cb, sb = net.fd_stencil(x.cuda(), 0.01, precision="bf16")
    d64, db = s64 - c64.detach(), (sb - cb.detach()).double().cpu()
    assert ((cb.detach().double().cpu() - c64.detach()).norm() / c64.norm()) < 1e-2
    assert ((db - d64).norm() / d64.norm()) < 1e-2


def test_softplus_equals_torch_with_first_and_second_derivatives():
    a = torch.cat([torch.linspace(-40, 40, 801), torch.randn(1000) * 5]).double()
    a.requires_grad_(True)
    ref = F.softplus(a)
    got = softplus(a.float()).double()
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    # first and second derivatives (the exact Laplacian differentiates twice), in float64
    (g_ref,) = torch.autograd.grad(ref.sum(), a, create_graph=True)
    out = softplus(a)
    (g,) = torch.autograd.grad(out.sum(), a, create_graph=True)
    torch.testing.assert_close(g, g_ref)
    (h_ref,) = torch.autograd.grad(g_ref.sum(), a)
    (h,) = torch.autograd.grad(g.sum(), a)
    torch.testing.assert_close(h, h_ref)
    # float64 agrees to rounding (F.softplus returns a itself past its threshold, 20)
    torch.testing.assert_close(softplus(a), F.softplus(a, threshold=1e3), atol=1e-12, rtol=1e-12)
