"""Learning, not just algebra: NestedLoRA recovers spectra in order, checked against
torch.linalg.svd / eigh."""

import pytest
import torch

from training.demo import FitConfig, fit_evd, fit_svd, main, random_matrix
from training.loss import cdk_loss, nesting_masks, singular_values

DT = torch.float64
TOP8 = torch.linspace(1.0, 0.3, 8, dtype=DT)


def abs_cos(A, V):
    """|cos| between row a_l of A (L, n) and column l of V (n, L)."""
    return (A @ V).diagonal().abs() / (A.norm(dim=1) * V.norm(dim=0))


def sin_max_angle(A, V):
    """Sine of the largest principal angle between span(rows of A) and span(columns of V)."""
    Qa, _ = torch.linalg.qr(A.T)
    Qv, _ = torch.linalg.qr(V)
    return torch.linalg.matrix_norm(Qa - Qv @ (Qv.T @ Qa), ord=2).item()


@pytest.fixture(scope="module")
def matrix():
    s = torch.cat([TOP8, torch.linspace(0.25, 0.01, 40, dtype=DT)])
    return random_matrix(64, 48, s, seed=0)


@pytest.mark.parametrize("nesting", ["joint", "sequential"])
def test_svd_of_64x48_matrix_in_order(matrix, nesting):
    A, B, history = fit_svd(matrix, FitConfig(L=8, nesting=nesting, steps=1500, seed=1))
    U, S, Vh = torch.linalg.svd(matrix)
    sigma = A.norm(dim=1) * B.norm(dim=1)
    assert ((sigma - S[:8]).abs() / S[:8]).max() < 1e-3
    assert abs_cos(A, U[:, :8]).min() > 0.999
    assert abs_cos(B, Vh[:8].T).min() > 0.999
    assert history[-1] < history[0]


@pytest.mark.parametrize("nesting", ["joint", "sequential"])
def test_evd_of_psd_matrix_in_order(nesting):
    lam = torch.cat([TOP8, torch.linspace(0.25, 0.0, 24, dtype=DT)])
    Q, _ = torch.linalg.qr(
        torch.randn(32, 32, generator=torch.Generator().manual_seed(3), dtype=DT)
    )
    K = Q @ torch.diag(lam) @ Q.T
    A, _ = fit_evd(K, FitConfig(L=8, nesting=nesting, steps=1500, seed=4))
    evals, evecs = torch.linalg.eigh(K)
    evals, evecs = evals.flip(0)[:8], evecs.flip(1)[:, :8]
    est = A.norm(dim=1) ** 2
    assert ((est - evals).abs() / evals).max() < 1e-3
    assert abs_cos(A, evecs).min() > 0.999


@pytest.mark.parametrize("nesting", ["joint", "sequential"])
def test_modes_beyond_positive_spectrum_vanish(nesting):
    # Only r = 5 positive eigenvalues; L = 8 modes are learned: modes 6..8 must go to zero.
    lam = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2] + [-0.1 * k for k in range(1, 20)], dtype=DT)
    gen = torch.Generator().manual_seed(5)
    Q, _ = torch.linalg.qr(torch.randn(24, 24, generator=gen, dtype=DT))
    K = Q @ torch.diag(lam) @ Q.T
    extra = []
    for steps in (750, 3000):
        cfg = FitConfig(L=8, nesting=nesting, steps=steps, lr=5e-2, lr_final=1e-3, seed=6)
        A, _ = fit_evd(K, cfg)
        est = A.norm(dim=1) ** 2
        extra.append(est[5:].max().item())
    assert ((est[:5] - lam[:5]).abs() / lam[:5]).max() < 1e-3
    assert abs_cos(A[:5], Q[:, :5]).min() > 0.999
    # The surplus modes shrink as training goes on (the loss is only cubic in directions the
    # first r modes already hold, so they decay slowly rather than converge fast).
    assert extra[1] < 2e-4 and extra[1] < extra[0] / 3


def test_plain_lora_learns_the_subspace_but_not_the_order(matrix):
    A, B, _ = fit_svd(matrix, FitConfig(L=8, nesting="none", steps=1500, seed=1))
    U, S, Vh = torch.linalg.svd(matrix)
    assert sin_max_angle(A, U[:, :8]) < 1e-4
    assert sin_max_angle(B, Vh[:8].T) < 1e-4
    # The rank-8 approximation is exact ...
    approx = A.T @ B
    best = U[:, :8] @ torch.diag(S[:8]) @ Vh[:8]
    assert (approx - best).norm() / best.norm() < 1e-4
    # ... but the individual vectors are rotated within it: none is a singular vector.
    best_match = (A @ U[:, :8]).abs().max(dim=1).values / A.norm(dim=1)
    assert best_match.max() < 0.99


def _cdk_problem(nx=12, ny=10, seed=7):
    """A discrete p(x, y) whose CDK has known singular values (the pairs' dependence)."""
    gen = torch.Generator().manual_seed(seed)
    px = torch.rand(nx, generator=gen, dtype=DT) + 0.5
    py = torch.rand(ny, generator=gen, dtype=DT) + 0.5
    px, py = px / px.sum(), py / py.sum()
    k = 3

    def orthonormal(p, n):
        # columns orthonormal in L2(p) and orthogonal to the constant function
        Z = torch.cat([torch.ones(n, 1, dtype=DT), torch.randn(n, k, generator=gen, dtype=DT)], 1)
        Q, _ = torch.linalg.qr(p.sqrt()[:, None] * Z)
        return Q[:, 1:] / p.sqrt()[:, None]

    u, v = orthonormal(px, nx), orthonormal(py, ny)
    s = torch.tensor([0.6, 0.4, 0.2], dtype=DT)
    s = s * 0.9 / (u @ torch.diag(s) @ v.T).abs().max().clamp(min=1.0)  # keep p(x, y) > 0
    P = px[:, None] * py[None, :] * (1 + u @ torch.diag(s) @ v.T)
    assert bool((P > 0).all())
    return P, px, py


def test_cdk_learned_from_paired_samples():
    P, px, py = _cdk_problem()
    # Independent reference: SVD of D_x^1/2 (P / (px py^T) - 1) D_y^1/2.
    kernel = P / (px[:, None] * py[None, :]) - 1
    Uk, Sk, Vkh = torch.linalg.svd(px.sqrt()[:, None] * kernel * py.sqrt()[None, :])
    L = 3
    gen = torch.Generator().manual_seed(8)
    Fx = (0.1 * torch.randn(len(px), L, generator=gen, dtype=DT)).requires_grad_()
    Gy = (0.1 * torch.randn(len(py), L, generator=gen, dtype=DT)).requires_grad_()
    m, M = nesting_masks(L, "joint", constant_mode=True)
    steps, batch = 1500, 2048
    opt = torch.optim.Adam([Fx, Gy], lr=2e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=1e-4)
    flat = P.flatten()
    for _ in range(steps):
        idx = torch.multinomial(flat, batch, replacement=True, generator=gen)
        xs, ys = idx // P.shape[1], idx % P.shape[1]
        opt.zero_grad()
        cdk_loss(Fx[xs], Gy[ys], m, M).backward()
        opt.step()
        sched.step()
    Fx, Gy = Fx.detach(), Gy.detach()
    # Population norms under p(x), p(y) (the estimator of the spectrum, on exact marginals).
    sigma = singular_values(
        Fx * (len(px) * px).sqrt()[:, None], Gy * (len(py) * py).sqrt()[:, None]
    )
    assert ((sigma - Sk[:L]).abs() / Sk[:L]).max() < 0.03
    # Singular functions in L2(p): compare sqrt(p) f with the reference left vectors.
    cos_f = abs_cos((px.sqrt()[:, None] * Fx).T, Uk[:, :L])
    cos_g = abs_cos((py.sqrt()[:, None] * Gy).T, Vkh[:L].T)
    assert cos_f.min() > 0.99 and cos_g.min() > 0.99
    # Learned functions are orthogonal to the constant mode (mean zero under the marginals).
    assert (px @ Fx).abs().max() < 0.05 and (py @ Gy).abs().max() < 0.05


def test_demo_prints_the_recovered_spectrum(capsys):
    main(["--steps", "800", "--L", "4"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4
    for row in rows:
        assert float(row[3]) < 1e-3  # relative error of each singular value
