"""SpIN's masked gradient equals autograd of the masked trace; NeuralEF and NestedLoRA are
stationary at the exact eigenvectors of a finite-dimensional operator."""

import torch

from training.pde.baselines import NeuralEF, SpIN
from training.pde.methods import NestedLoRA, make_method
from training.pde.networks import DisjointMLPs


def _setup(L=4, B=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    net = DisjointMLPs(L, 2, 6, 0.5, 8, generator=gen).double()
    x = torch.randn(B, 2, generator=gen, dtype=torch.float64)
    a = torch.randn(B, B, generator=gen, dtype=torch.float64)
    K = a @ a.T / B  # a symmetric PSD operator on functions sampled at x
    return net, x, K


def _masked_trace_gradient(net, x, K):
    """Reference: sum_l d Lambda_ll / d theta through phi_l only (phi_{!=l} held fixed),
    Lambda = Lc^-1 Pi Lc^-T with Sigma = phi^T phi / B, Pi = phi^T K phi / B."""
    B, params = x.shape[0], list(net.parameters())
    phi = net(x)
    L = phi.shape[1]
    total = [torch.zeros_like(p) for p in params]
    for l in range(L):
        cols = [phi[:, i] if i == l else phi[:, i].detach() for i in range(L)]
        p = torch.stack(cols, -1)
        chol = torch.linalg.cholesky(p.T @ p / B)
        ci = torch.linalg.inv(chol)
        lam = ci @ (p.T @ K @ p / B) @ ci.T
        grads = torch.autograd.grad(lam[l, l], params, retain_graph=True)
        total = [t + g for t, g in zip(total, grads, strict=True)]
    return total


def test_spin_gradient_matches_autograd_of_the_masked_trace():
    net, x, K = _setup()
    ref = _masked_trace_gradient(net, x, K)
    # decay 0: the moving averages are this batch's estimates; no jitter: exact Cholesky
    spin = SpIN(4, decay=0.0, jitter=0.0)
    ft = net(x)
    loss, eigs = spin(ft, (K @ ft).detach(), net.parameters())
    grads = torch.autograd.grad(loss, list(net.parameters()))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, -r)  # SpIN descends on -tr(Lambda)
    assert eigs.shape == (4,)


def test_spin_moving_averages_are_kept_and_restored():
    net, x, K = _setup()
    spin = SpIN(4, decay=0.5)
    for _ in range(2):
        ft = net(x)
        spin(ft, (K @ ft).detach(), net.parameters())
    state = spin.state_dict()
    other = SpIN(4, decay=0.5)
    other.load_state_dict(state)
    torch.testing.assert_close(other.sigma, spin.sigma)
    assert len(other.jac) == len(list(net.parameters()))
    assert other.jac[0].shape == (4, *net.w1.shape)  # L copies of the parameters


def _eigen_setup(L=3, B=40, seed=1):
    """Columns orthonormal on each half of the batch (the estimators split it) and an
    operator acting as T v_l = lambda_l v_l on them."""
    gen = torch.Generator().manual_seed(seed)
    halves = []
    for _ in range(2):
        q, _ = torch.linalg.qr(torch.randn(B // 2, L, generator=gen, dtype=torch.float64))
        halves.append(q * (B // 2) ** 0.5)  # q^T q / (B/2) = I
    v = torch.cat(halves)
    lam = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    return v, lam


def test_neuralef_and_nestedlora_are_stationary_at_the_eigenvectors():
    v, lam = _eigen_setup()
    # NeuralEF: normalised eigenvectors with T phi = lambda phi have zero update
    ft = v.clone().requires_grad_(True)
    loss, eigs = NeuralEF(3)(ft, v * lam)
    (g,) = torch.autograd.grad(loss, ft)
    assert g.abs().max() < 1e-10
    torch.testing.assert_close(eigs, lam)
    # NestedLoRA (sequential and joint): the minimiser is sqrt(lambda) v
    for nesting in ("sequential", "joint"):
        f = (v * lam.sqrt()).requires_grad_(True)
        loss, eigs = NestedLoRA(3, nesting)(f, f.detach() * lam)
        (g,) = torch.autograd.grad(loss, f)
        assert g.abs().max() < 1e-10
        torch.testing.assert_close(eigs, lam)


def test_neuralef_moves_off_the_eigenvectors_and_keeps_the_order():
    v, lam = _eigen_setup()
    # mode 1 mixed with mode 0: its update must remove the mode-0 component
    ft = v.clone()
    ft[:, 1] = v[:, 1] + 0.3 * v[:, 0]
    Tft = v * lam
    Tft[:, 1] = lam[1] * v[:, 1] + 0.3 * lam[0] * v[:, 0]
    ft.requires_grad_(True)
    loss, _ = NeuralEF(3)(ft, Tft)
    (g,) = torch.autograd.grad(loss, ft)
    assert g[:, 0].abs().max() < 1e-10  # mode 0 is already an eigenvector
    # a gradient step lowers the overlap of mode 1 with mode 0
    new = ft.detach() - 0.01 * g
    overlap = lambda f: ((f[:, 1] * v[:, 0]).mean() / f[:, 1].norm()).abs()  # noqa: E731
    assert overlap(new) < overlap(ft.detach())


def test_methods_registry():
    for name in ("neuralsvd-seq", "neuralsvd-jnt", "lora", "neuralef", "spin"):
        make_method(name, 3, type("C", (), {"spin_decay": 0.9})())
    try:
        make_method("pca", 3, None)
    except ValueError as e:
        assert "unknown method 'pca'" in str(e)
    else:
        raise AssertionError("an unknown method must be an error")
