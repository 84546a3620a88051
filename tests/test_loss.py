"""The NestedLoRA estimators against independent references.

References are written as the paper's double sum over nested prefixes,
sum_l w_l L_LoRA(f_1:l, g_1:l), without masks, and differentiated by plain autograd. For
sequential nesting the reference differentiates each L_LoRA(f_1:l, g_1:l) with the earlier
modes detached, which is the definition of the sequential update.
"""

import itertools

import pytest
import torch

from training.loss import (
    cdk_loss,
    eigenvalues,
    evd_loss,
    nesting_masks,
    singular_values,
    svd_loss,
)

DT = torch.float64
RTOL = 1e-8


def assert_rel_close(actual, expected, rtol=RTOL):
    err = (actual - expected).norm() / expected.norm()
    assert err < rtol, f"relative error {err:.2e} >= {rtol:.0e}"


def prefix(F, l, sequential):
    """Columns 0..l-1 of F; for sequential nesting only column l-1 keeps its gradient."""
    if not sequential:
        return F[:, :l]
    return torch.cat([F[:, : l - 1].detach(), F[:, l - 1 : l]], dim=1)


def nested_sum(weights, L, lora_l):
    return sum(weights[l - 1] * lora_l(l) for l in range(1, L + 1))


# --------------------------------------------------------------------------- masks


def test_joint_masks_follow_their_definition():
    w = torch.rand(7, dtype=DT) + 0.1
    m, M = nesting_masks(7, "joint", weights=w)
    for i in range(7):
        assert m[i] == pytest.approx(w[i:].sum().item(), rel=1e-14)
        for j in range(7):
            assert M[i, j] == m[max(i, j)]


def test_uniform_weights():
    m, _ = nesting_masks(4)
    torch.testing.assert_close(m, torch.tensor([1.0, 0.75, 0.5, 0.25], dtype=DT))


def test_sequential_and_constant_mode_masks():
    m, M = nesting_masks(3, "sequential", constant_mode=True)
    assert m.tolist() == [1.0] * 4
    assert M.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]]
    m, M = nesting_masks(3, "joint", constant_mode=True)
    # the constant mode belongs to every prefix: same weight as mode 1
    torch.testing.assert_close(m, torch.tensor([1.0, 1.0, 2 / 3, 1 / 3], dtype=DT))
    assert M.shape == (4, 4)
    m, M = nesting_masks(5, "none")
    assert bool((m == 1).all()) and bool((M == 1).all())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(L=0), "L must be a positive integer"),
        (dict(L=3, nesting="nested"), "nesting must be one of"),
        (dict(L=3, weights=[1.0, 2.0]), "weights must have L=3"),
        (dict(L=3, weights=[1.0, 0.0, 1.0]), "weights must be positive"),
        (dict(L=3, nesting="sequential", weights=[1, 1, 1]), "joint nesting only"),
    ],
)
def test_mask_errors_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nesting_masks(**kwargs)


# --------------------------------------------------------------------------- EVD


def evd_reference(F, K, perm, weights, sequential):
    """sum_l w_l L_LoRA(f_1:l) on the batch F[perm], T = K / N on the uniform measure.

    The metric term <f_i, f_j>^2 is the product of the estimates on the two halves.
    """
    N, L = F.shape
    B1 = (N + 1) // 2

    def lora(l):
        Fl = prefix(F, l, sequential)
        TFl = K @ Fl / N  # T applied to the live functions: the operator term is quadratic
        f, Tf = Fl[perm], TFl[perm]
        operator = -2 * sum((f[:, i] * Tf[:, i]).mean() for i in range(l))
        f1, f2 = f[:B1], f[B1:]
        metric = sum(
            (f1[:, i] * f1[:, j]).mean() * (f2[:, i] * f2[:, j]).mean()
            for i in range(l)
            for j in range(l)
        )
        return operator + metric

    return nested_sum(weights, L, lora)


@pytest.mark.parametrize("nesting", ["joint", "sequential"])
@pytest.mark.parametrize("N", [12, 13])  # even and odd batches (unequal halves)
def test_evd_gradient_matches_autograd_of_nested_sum(nesting, N):
    torch.manual_seed(0)
    L = 5
    K = torch.randn(N, N, dtype=DT)
    K = K + K.T
    F = torch.randn(N, L, dtype=DT, requires_grad=True)
    perm = torch.randperm(N)  # the batch visits every point once, in random order
    w = torch.rand(L, dtype=DT) + 0.1 if nesting == "joint" else torch.ones(L, dtype=DT)
    m, M = nesting_masks(L, nesting, weights=w if nesting == "joint" else None)

    loss = evd_loss(F[perm], (K @ F / N)[perm].detach(), m, M)
    (grad,) = torch.autograd.grad(loss, F)
    ref = evd_reference(F, K, perm, w, sequential=nesting == "sequential")
    (ref_grad,) = torch.autograd.grad(ref, F)
    assert_rel_close(grad, ref_grad)
    if nesting == "joint":
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


# --------------------------------------------------------------------------- SVD


def svd_reference(F, G, K, px, py, weights, sequential):
    """sum_l w_l L_LoRA(f_1:l, g_1:l) for (T g)(x) = mean_y K(x, y) g(y)."""
    Nx, L = F.shape
    Ny = G.shape[0]

    def lora(l):
        Fl, Gl = prefix(F, l, sequential), prefix(G, l, sequential)
        TGl = K @ Gl / Ny
        f, Tg, g = Fl[px], TGl[px], Gl[py]
        operator = -2 * sum((f[:, i] * Tg[:, i]).mean() for i in range(l))
        metric = sum(
            (f[:, i] * f[:, j]).mean() * (g[:, i] * g[:, j]).mean()
            for i in range(l)
            for j in range(l)
        )
        return operator + metric

    return nested_sum(weights, L, lora)


@pytest.mark.parametrize("nesting", ["joint", "sequential"])
def test_svd_gradient_matches_autograd_of_nested_sum(nesting):
    torch.manual_seed(1)
    Nx, Ny, L = 11, 7, 4
    K = torch.randn(Nx, Ny, dtype=DT)
    F = torch.randn(Nx, L, dtype=DT, requires_grad=True)
    G = torch.randn(Ny, L, dtype=DT, requires_grad=True)
    px, py = torch.randperm(Nx), torch.randperm(Ny)
    w = torch.rand(L, dtype=DT) + 0.1 if nesting == "joint" else torch.ones(L, dtype=DT)
    m, M = nesting_masks(L, nesting, weights=w if nesting == "joint" else None)

    Tg = (K @ G / Ny)[px].detach()
    Tadj_f = (K.T @ F / Nx)[py].detach()
    loss = svd_loss(F[px], Tg, G[py], Tadj_f, m, M)
    grad_f, grad_g = torch.autograd.grad(loss, (F, G))
    ref = svd_reference(F, G, K, px, py, w, sequential=nesting == "sequential")
    ref_f, ref_g = torch.autograd.grad(ref, (F, G))
    assert_rel_close(grad_f, ref_f)
    assert_rel_close(grad_g, ref_g)
    if nesting == "joint":
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


# --------------------------------------------------------------------------- CDK


def cdk_reference(f, g, weights, sequential):
    """sum_l w_l L_LoRA(f_0:l, g_0:l) with the constant mode f_0 = g_0 = 1 in every prefix.

    The metric term is E_{p(x)p(y)}[(f_0:l(X) . g_0:l(Y))^2], estimated over the pairs
    b != b' of the batch (b = b' pairs are dependent draws from p(x, y)).
    """
    B, L = f.shape
    ones = torch.ones(B, 1, dtype=f.dtype)
    fa, ga = torch.cat([ones, f], 1), torch.cat([ones, g], 1)
    off_diagonal = ~torch.eye(B, dtype=torch.bool)

    def lora(l):
        fl, gl = prefix(fa, l + 1, sequential), prefix(ga, l + 1, sequential)
        operator = -2 * (fl * gl).sum(1).mean()
        metric = ((fl @ gl.T)[off_diagonal] ** 2).mean()
        return operator + metric

    return nested_sum(weights, L, lora)


@pytest.mark.parametrize("nesting", ["joint", "sequential"])
def test_cdk_gradient_matches_autograd_of_nested_sum(nesting):
    torch.manual_seed(2)
    B, L = 9, 4
    f = torch.randn(B, L, dtype=DT, requires_grad=True)
    g = torch.randn(B, L, dtype=DT, requires_grad=True)
    w = torch.rand(L, dtype=DT) + 0.1 if nesting == "joint" else torch.ones(L, dtype=DT)
    m, M = nesting_masks(L, nesting, weights=w if nesting == "joint" else None, constant_mode=True)
    loss = cdk_loss(f, g, m, M)
    grad_f, grad_g = torch.autograd.grad(loss, (f, g))
    ref = cdk_reference(f, g, w, sequential=nesting == "sequential")
    ref_f, ref_g = torch.autograd.grad(ref, (f, g))
    assert_rel_close(grad_f, ref_f)
    assert_rel_close(grad_g, ref_g)
    if nesting == "joint":
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


def test_sequential_value_is_the_full_lora_objective():
    torch.manual_seed(3)
    f, g = torch.randn(10, 3, dtype=DT), torch.randn(10, 3, dtype=DT)
    seq = cdk_loss(f, g, *nesting_masks(3, "sequential", constant_mode=True))
    full = cdk_loss(f, g, *nesting_masks(3, "none", constant_mode=True))
    ref = cdk_reference(f, g, [0, 0, 1], sequential=False)  # w = (0, 0, 1): L_LoRA(f_0:3)
    assert seq.item() == pytest.approx(full.item(), rel=1e-12)
    assert seq.item() == pytest.approx(ref.item(), rel=1e-12)


# --------------------------------------------------------------------------- unbiasedness


def _discrete_joint(nx, ny, seed):
    gen = torch.Generator().manual_seed(seed)
    P = torch.rand(nx, ny, generator=gen, dtype=DT) + 0.05
    return P / P.sum()


def population_cdk_grad(P, Fx, Gy, m, M):
    """Exact NestedLoRA gradient for the CDK of the discrete joint P (tables Fx, Gy)."""
    px, py = P.sum(1), P.sum(0)
    Fx = Fx.clone().requires_grad_()
    Gy = Gy.clone().requires_grad_()
    fa = torch.cat([torch.ones(len(px), 1, dtype=DT), Fx], 1)
    ga = torch.cat([torch.ones(len(py), 1, dtype=DT), Gy], 1)
    operator = -2 * (m * torch.einsum("xy,xl,yl->l", P, fa, ga)).sum()
    lam_f = torch.einsum("x,xi,xj->ij", px, fa, fa)
    lam_g = torch.einsum("y,yi,yj->ij", py, ga, ga)
    metric = (M * lam_f * lam_g).sum()
    return torch.autograd.grad(operator + metric, (Fx, Gy))


def expected_batch_grad(P, Fx, Gy, loss_fn):
    """E over all batches of two i.i.d. pairs from P of the estimator's gradient."""
    nx, ny = P.shape
    pairs = list(itertools.product(range(nx), range(ny)))
    gF, gG = torch.zeros_like(Fx), torch.zeros_like(Gy)
    for (x1, y1), (x2, y2) in itertools.product(pairs, pairs):
        Fl, Gl = Fx.clone().requires_grad_(), Gy.clone().requires_grad_()
        xs, ys = torch.tensor([x1, x2]), torch.tensor([y1, y2])
        dF, dG = torch.autograd.grad(loss_fn(Fl[xs], Gl[ys]), (Fl, Gl))
        weight = P[x1, y1] * P[x2, y2]
        gF += weight * dF
        gG += weight * dG
    return gF, gG


def test_cdk_gradient_is_unbiased_even_at_batch_two():
    P = _discrete_joint(3, 3, seed=4)
    gen = torch.Generator().manual_seed(5)
    Fx, Gy = torch.randn(3, 2, generator=gen, dtype=DT), torch.randn(3, 2, generator=gen, dtype=DT)
    m, M = nesting_masks(2, "joint", constant_mode=True)
    exact = population_cdk_grad(P, Fx, Gy, m, M)
    est = expected_batch_grad(P, Fx, Gy, lambda f, g: cdk_loss(f, g, m, M))
    assert_rel_close(est[0], exact[0], rtol=1e-10)
    assert_rel_close(est[1], exact[1], rtol=1e-10)

    # The test has teeth: the same metric estimated with the dependent pairs included
    # (one Gram matrix per modality on the whole batch) is biased at this batch size.
    def naive(f, g):
        ones = torch.ones(f.shape[0], 1, dtype=DT)
        fa, ga = torch.cat([ones, f], 1), torch.cat([ones, g], 1)
        lam_f, lam_g = fa.T @ fa / len(fa), ga.T @ ga / len(ga)
        return -2 * (m * (fa * ga).mean(0)).sum() + (M * lam_f * lam_g).sum()

    biased = expected_batch_grad(P, Fx, Gy, naive)
    assert (biased[0] - exact[0]).norm() / exact[0].norm() > 1e-3


def test_evd_gradient_is_unbiased_even_at_batch_two():
    # Operator K on 3 points with uniform measure; batches of two i.i.d. uniform points.
    gen = torch.Generator().manual_seed(6)
    n, L = 3, 2
    K = torch.randn(n, n, generator=gen, dtype=DT)
    K = K + K.T
    F = torch.randn(n, L, generator=gen, dtype=DT)
    m, M = nesting_masks(L, "joint")
    Fp = F.clone().requires_grad_()
    lam = Fp.T @ Fp / n
    exact = -2 * (m * (Fp * (K @ Fp / n)).mean(0)).sum() + (M * lam * lam).sum()
    (exact_grad,) = torch.autograd.grad(exact, Fp)
    est = torch.zeros_like(F)
    for x1, x2 in itertools.product(range(n), range(n)):
        Fl = F.clone().requires_grad_()
        xs = torch.tensor([x1, x2])
        (d,) = torch.autograd.grad(evd_loss(Fl[xs], (K @ F / n)[xs], m, M), Fl)
        est += d / n**2
    assert_rel_close(est, exact_grad, rtol=1e-10)


# --------------------------------------------------------------------------- spectrum


def test_spectrum_from_norms():
    # Scaled orthonormal functions on the basis measure: norms give the spectrum back.
    s = torch.tensor([0.9, 0.5, 0.1], dtype=DT)
    Q, _ = torch.linalg.qr(torch.randn(6, 3, dtype=DT))
    X = 6**0.5 * torch.eye(6, dtype=DT)  # samples with E[x x^T] = I
    f = X @ (Q * s.sqrt())  # f_l = sqrt(s_l) phi_l
    torch.testing.assert_close(singular_values(f, f), s)
    torch.testing.assert_close(eigenvalues(f), s)
    g = X @ (Q * s / 2)  # unbalanced scales: only the product matters
    torch.testing.assert_close(singular_values(2 * X @ Q, g), s)


# --------------------------------------------------------------------------- input handling


def test_shape_and_mask_errors_are_clear():
    f = torch.randn(8, 3)
    m, M = nesting_masks(3)
    with pytest.raises(ValueError, match=r"Tf has shape \(8, 2\) but f has \(8, 3\)"):
        evd_loss(f, torch.randn(8, 2), m, M)
    with pytest.raises(ValueError, match="masks must have shapes"):
        cdk_loss(f, f, m, M)  # CDK needs L+1 masks
    with pytest.raises(ValueError, match="f has L=3 modes but g has L=2"):
        svd_loss(f, f, torch.randn(5, 2), torch.randn(5, 2), m, M)
    with pytest.raises(ValueError, match=r"must have shape \(B, L\)"):
        evd_loss(torch.randn(8), torch.randn(8), m, M)
    with pytest.raises(ValueError, match="at least 2"):
        cdk_loss(torch.randn(1, 3), torch.randn(1, 3), *nesting_masks(3, constant_mode=True))
    with pytest.raises(TypeError, match="floating point"):
        evd_loss(torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3), m, M)


def test_operator_outputs_get_no_gradient():
    f = torch.randn(6, 2, requires_grad=True)
    Tf = torch.randn(6, 2, requires_grad=True)
    evd_loss(f, Tf, *nesting_masks(2)).backward()
    assert f.grad is not None and Tf.grad is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    torch.manual_seed(7)
    f32, g32 = torch.randn(64, 4), torch.randn(64, 4)
    m, M = nesting_masks(4, constant_mode=True)
    f = f32.to(dtype).requires_grad_()
    g = g32.to(dtype).requires_grad_()
    loss = cdk_loss(f, g, m, M)
    loss.backward()
    assert loss.dtype == dtype and f.grad.dtype == dtype
    ref = cdk_loss(f.detach().float(), g.detach().float(), m, M)
    assert loss.float().item() == pytest.approx(ref.item(), rel=1e-2)


def test_runs_under_autocast():
    torch.manual_seed(8)
    lin_f, lin_g = torch.nn.Linear(10, 4), torch.nn.Linear(10, 4)
    x = torch.randn(32, 10)
    m, M = nesting_masks(4, constant_mode=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f, g = lin_f(x), lin_g(x)
        assert f.dtype == torch.bfloat16
        loss = cdk_loss(f, g, m, M)
    loss.backward()
    assert torch.isfinite(lin_f.weight.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    torch.manual_seed(9)
    f, g = torch.randn(32, 4, dtype=DT), torch.randn(32, 4, dtype=DT)
    m, M = nesting_masks(4, constant_mode=True)
    cpu = cdk_loss(f, g, m, M)
    gpu = cdk_loss(f.cuda(), g.cuda(), m, M)
    assert gpu.item() == pytest.approx(cpu.item(), rel=1e-10)
