"""NestedLoRA: the nested low-rank approximation objective and its unbiased gradients.

The LoRA objective of an operator T with L learned pairs (f_l, g_l) is

    L(f_1:L, g_1:L) = -2 sum_l <g_l, T f_l> + sum_{l,l'} <f_l, f_l'> <g_l, g_l'>,

the squared Hilbert-Schmidt error of the rank-L expansion sum_l |f_l><g_l| up to a constant.
Nesting makes the minimisers the top-L singular functions *in order*, scaled by their
singular values:

* joint nesting minimises sum_l w_l L(f_1:l, g_1:l) for positive weights w. Written in one
  shot it is -2 sum_l m_l <g_l, T f_l> + sum_ij M_ij <f_i,f_j><g_i,g_j> with the vector mask
  m_l = sum_{i>=l} w_i and the matrix mask M_ij = m_max(i,j);
* sequential nesting moves each pair (f_l, g_l) along the gradient of its own L(f_1:l, g_1:l),
  treating the modes before it as fixed: m_l = 1 and M_il = 1{i <= l}.

Both are served by one gradient formula, (d/df_l) = 2 {-m_l T*g_l + sum_i M_il f_i <g_i, g_l>},
implemented here by hand (x1.04-1.48 the speed of autograd of the objective, most at large
B L^2; benchmarks/loss_bench.py).
Every estimator returns the objective's minibatch estimate as a scalar, so it can be logged,
and backpropagates the unbiased NestedLoRA gradient into f and g. The operator outputs
(Tf, Tg, Tadj_f) are inputs, never differentiated.

For sequential nesting there is no single objective; the value reported is the full LoRA
objective L(f_1:L, g_1:L), the last of the nested objectives it minimises.
"""

from __future__ import annotations

import torch

__all__ = [
    "NESTINGS",
    "nesting_masks",
    "evd_loss",
    "svd_loss",
    "cdk_loss",
    "singular_values",
    "cdk_singular_values",
    "eigenvalues",
]

NESTINGS = ("joint", "sequential", "none")


def nesting_masks(
    L: int,
    nesting: str = "joint",
    weights=None,
    constant_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vector and matrix masks, (L,) and (L, L) in float64, or (L+1,) / (L+1, L+1) with
    ``constant_mode`` (the CDK's fixed constant first mode, weighted like mode 1).

    nesting: "joint" (weights w: (L,) positive, uniform 1/L by default), "sequential", or
    "none" (the plain LoRA objective, which learns the top-L subspace but not its order).
    """
    if not isinstance(L, int) or L < 1:
        raise ValueError(f"L must be a positive integer, got {L!r}")
    if nesting not in NESTINGS:
        raise ValueError(f"nesting must be one of {NESTINGS}, got {nesting!r}")
    if nesting != "joint" and weights is not None:
        raise ValueError(f"weights apply to joint nesting only, not {nesting!r}")

    if nesting == "joint":
        if weights is None:
            w = torch.full((L,), 1.0 / L, dtype=torch.float64)
        else:
            w = torch.as_tensor(weights, dtype=torch.float64).flatten()
            if w.numel() != L:
                raise ValueError(f"weights must have L={L} entries, got {w.numel()}")
            if not bool((w > 0).all()):
                raise ValueError(f"weights must be positive, got {w.tolist()}")
        m = w.flip(0).cumsum(0).flip(0)  # m_l = sum_{i >= l} w_i, non-increasing
        if constant_mode:
            m = torch.cat([m[:1], m])
        M = torch.minimum(m[:, None], m[None, :])  # m_max(i,j) since m is non-increasing
        return m, M

    n = L + 1 if constant_mode else L
    m = torch.ones(n, dtype=torch.float64)
    if nesting == "sequential":
        M = torch.triu(torch.ones(n, n, dtype=torch.float64))  # M_il = 1{i <= l}
    else:
        M = torch.ones(n, n, dtype=torch.float64)
    return m, M


# --------------------------------------------------------------------------- helpers


def _check_2d(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (B, L), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")


def _check_same(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        _check_2d(name, x)
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has {tuple(ref.shape)}"
            )
        if x.device != ref.device:
            raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def _masks(vector_mask, matrix_mask, n: int, like: torch.Tensor, what: str):
    m = torch.as_tensor(vector_mask)
    M = torch.as_tensor(matrix_mask)
    if m.shape != (n,) or M.shape != (n, n):
        raise ValueError(
            f"masks must have shapes ({n},) and ({n}, {n}) for {what}, "
            f"got {tuple(m.shape)} and {tuple(M.shape)}"
        )
    m = m.to(device=like.device, dtype=like.dtype)
    M = M.to(device=like.device, dtype=like.dtype)
    # Value of the metric term: max(M, M^T) is M itself for joint nesting and all ones for
    # sequential nesting, whose reported value is the full LoRA objective.
    return m, M, torch.maximum(M, M.T)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Half precision loses the objective's cancellations: compute in at least float32.
    return torch.promote_types(x.dtype, torch.float32)


def _gram(x: torch.Tensor) -> torch.Tensor:
    return x.T @ x / x.shape[0]  # (L, L): <x_i, x_j> estimated on the batch


class _EVD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, Tf, m, M, Msym):
        B1 = (f.shape[0] + 1) // 2
        f1, f2 = f[:B1], f[B1:]
        lam1, lam2 = _gram(f1), _gram(f2)  # independent estimates of <f_i, f_j>
        ctx.save_for_backward(f, Tf, m, M, lam1, lam2)
        operator = -2.0 * ((f * Tf).mean(0) * m).sum()
        metric = (Msym * lam1 * lam2).sum()
        return operator + metric

    @staticmethod
    def backward(ctx, grad_out):
        f, Tf, m, M, lam1, lam2 = ctx.saved_tensors
        B = f.shape[0]
        B1 = (B + 1) // 2
        # <f, Tf> is quadratic in f for self-adjoint T: its gradient is 2 Tf per sample.
        grad = (-4.0 / B) * Tf * m
        grad[:B1] += (2.0 / B1) * f[:B1] @ (M * lam2)
        grad[B1:] += (2.0 / (B - B1)) * f[B1:] @ (M * lam1)
        return grad_out * grad, None, None, None, None


class _SVD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, Tg, g, Tadj_f, m, M, Msym):
        lam_f, lam_g = _gram(f), _gram(g)  # x- and y-samples are independent
        ctx.save_for_backward(f, Tg, g, Tadj_f, m, M, lam_f, lam_g)
        # <f, T g> estimated on both sample sets, averaged.
        operator = -(((f * Tg).mean(0) + (g * Tadj_f).mean(0)) * m).sum()
        metric = (Msym * lam_f * lam_g).sum()
        return operator + metric

    @staticmethod
    def backward(ctx, grad_out):
        f, Tg, g, Tadj_f, m, M, lam_f, lam_g = ctx.saved_tensors
        B1, B2 = f.shape[0], g.shape[0]
        grad_f = (2.0 / B1) * (f @ (M * lam_g) - Tg * m)
        grad_g = (2.0 / B2) * (g @ (M * lam_f) - Tadj_f * m)
        return grad_out * grad_f, None, grad_out * grad_g, None, None, None, None


class _CDK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, g, m, M, Msym):
        B = f.shape[0]
        ones = f.new_ones(B, 1)
        f = torch.cat([ones, f], dim=1)  # (B, L+1): constant first mode f_0 = 1
        g = torch.cat([ones, g], dim=1)
        lam_f, lam_g = _gram(f), _gram(g)
        h = f * g  # (B, L+1): per-pair products f_l(x_b) g_l(y_b)
        hM = h @ M  # (B, L+1): sum_i M_il f_i(x_b) g_i(y_b), reused by the backward
        ctx.save_for_backward(f, g, hM, m, M, lam_f, lam_g)
        # <g_l, K f_l> = E_{p(x,y)}[f_l(X) g_l(Y)]
        operator = -2.0 * (h.mean(0) * m).sum()
        # The metric term needs x and y independent; the pairs (x_b, y_b) are not, so the
        # U-statistic over all pairs b != b' removes the B paired terms h_b^T Msym h_b.
        if torch.equal(M, Msym):  # joint nesting
            paired = (hM * h).sum()
        elif bool((Msym == 1).all()):  # sequential: the value is the full LoRA objective
            paired = (h.sum(1) ** 2).sum()
        else:
            paired = ((h @ Msym) * h).sum()
        metric = (B * B * (Msym * lam_f * lam_g).sum() - paired) / (B * (B - 1))
        return operator + metric

    @staticmethod
    def backward(ctx, grad_out):
        f, g, hM, m, M, lam_f, lam_g = ctx.saved_tensors
        B = f.shape[0]
        c = 2.0 / (B * (B - 1))
        grad_f = c * (B * f @ (M * lam_g) - g * hM) - (2.0 / B) * g * m
        grad_g = c * (B * g @ (M * lam_f) - f * hM) - (2.0 / B) * f * m
        return grad_out * grad_f[:, 1:], grad_out * grad_g[:, 1:], None, None, None


def _run(fn, inputs: list[torch.Tensor], masks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Apply ``fn`` in full precision, outside autocast, and return the input dtype."""
    out_dtype = inputs[0].dtype
    dtype = _compute_dtype(inputs[0])
    with torch.autocast(device_type=inputs[0].device.type, enabled=False):
        inputs = [x.to(dtype) for x in inputs]
        return fn(*inputs, *(mk.to(dtype) for mk in masks)).to(out_dtype)


# --------------------------------------------------------------------------- estimators


def evd_loss(f, Tf, vector_mask, matrix_mask) -> torch.Tensor:
    """NestedLoRA for the EVD of a self-adjoint operator T.

    f, Tf: (B, L), the learned functions and T applied to them at B samples of the
    (importance-weighted) measure. The metric term <f_i,f_j>^2 is the product of the
    estimates on the two halves of the batch, which keeps the gradient unbiased.
    """
    _check_2d("f", f)
    _check_same("f", f, Tf=Tf)
    if f.shape[0] < 2:
        raise ValueError(f"evd_loss needs a batch of at least 2 samples, got {f.shape[0]}")
    m, M, Msym = _masks(vector_mask, matrix_mask, f.shape[1], f, "evd_loss")
    return _run(_EVD.apply, [f, Tf.detach()], (m, M, Msym))


def svd_loss(f, Tg, g, Tadj_f, vector_mask, matrix_mask) -> torch.Tensor:
    """NestedLoRA for the SVD of a general operator T from the y-space to the x-space.

    f, Tg: (B1, L), left functions and T g at B1 x-samples;
    g, Tadj_f: (B2, L), right functions and T* f at B2 y-samples, drawn independently.
    """
    _check_2d("f", f)
    _check_2d("g", g)
    _check_same("f", f, Tg=Tg)
    _check_same("g", g, Tadj_f=Tadj_f)
    if f.shape[1] != g.shape[1]:
        raise ValueError(f"f has L={f.shape[1]} modes but g has L={g.shape[1]}")
    if f.device != g.device:
        raise ValueError(f"f is on {f.device} but g is on {g.device}")
    m, M, Msym = _masks(vector_mask, matrix_mask, f.shape[1], f, "svd_loss")
    return _run(_SVD.apply, [f, Tg.detach(), g, Tadj_f.detach()], (m, M, Msym))


def cdk_loss(f, g, vector_mask, matrix_mask) -> torch.Tensor:
    """NestedLoRA for the canonical dependence kernel p(x, y) / (p(x) p(y)) - 1.

    f, g: (B, L), f(x_b) and g(y_b) for pairs (x_b, y_b) drawn from p(x, y). The constant
    first mode is appended inside, so the masks have size L+1
    (``nesting_masks(L, ..., constant_mode=True)``).
    """
    _check_2d("f", f)
    _check_same("f", f, g=g)
    if f.shape[0] < 2:
        raise ValueError(f"cdk_loss needs a batch of at least 2 pairs, got {f.shape[0]}")
    m, M, Msym = _masks(
        vector_mask, matrix_mask, f.shape[1] + 1, f, "cdk_loss (L+1 with the constant mode)"
    )
    return _run(_CDK.apply, [f, g], (m, M, Msym))


# --------------------------------------------------------------------------- spectrum


@torch.no_grad()
def singular_values(f: torch.Tensor, g: torch.Tensor,
                    photo_weights: torch.Tensor | None = None) -> torch.Tensor:
    """sigma_l = sqrt(E[f_l(X)^2] E[g_l(Y)^2]) from samples f: (B1, L), g: (B2, L) -> (L,).
    photo_weights: (B2,) the probability of each row of g under p(y) (summing to 1), when
    g is given at the distinct photos rather than at samples of p(y)."""
    _check_2d("f", f)
    _check_2d("g", g)
    if f.shape[1] != g.shape[1]:
        raise ValueError(f"f has L={f.shape[1]} modes but g has L={g.shape[1]}")
    f = f.to(_compute_dtype(f))
    g = g.to(f.dtype)
    return ((f**2).mean(0) * _mean(g**2, photo_weights)).sqrt()


def _mean(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """(B, L) -> (L,): the mean over rows, or the weighted sum with ``weights`` (B,)."""
    if weights is None:
        return x.mean(0)
    if weights.shape != (len(x),):
        raise ValueError(f"photo_weights must have one weight per row of g ({len(x)}), "
                         f"got shape {tuple(weights.shape)}")
    return weights.to(x.dtype) @ x


@torch.no_grad()
def cdk_singular_values(f: torch.Tensor, g: torch.Tensor, joint: torch.Tensor,
                        photo_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rayleigh quotients of the CDK k(x, y) = p(x, y) / (p(x) p(y)) - 1 at the learned pairs:

        sigma_l = <f_l, K g_l> / (|f_l| |g_l|)
                = (E_p(x,y)[f_l(X) g_l(Y)] - E f_l(X) E g_l(Y)) / sqrt(E f_l(X)^2 E g_l(Y)^2)

    from f: (B1, L) at samples of p(x), g: (B2, L) at samples of p(y) and joint: (L,) the
    expectation E_p(x,y)[f_l(X) g_l(Y)] (the sampler of pairs knows p(x, y);
    ``training.cdk.data.PairSampler.joint_moment``). When g is given at the distinct
    photos instead, photo_weights (B2,) is p(y) at them (``PairSampler.photo_marginal``):
    a photo that is drawn more often counts more in E g and E g^2. At exact singular pairs
    this equals ``singular_values``; near them its error is second order in the pairs'
    error (the norms' estimate is first order), which makes it the estimate to order modes
    by."""
    _check_2d("f", f)
    _check_2d("g", g)
    if not f.shape[1] == g.shape[1] == joint.shape[-1]:
        raise ValueError(f"f, g and joint disagree on L: {f.shape[1]}, {g.shape[1]}, "
                         f"{joint.shape[-1]}")
    dtype = _compute_dtype(f)
    f, g, joint = f.to(dtype), g.to(dtype), joint.to(dtype)
    cross = joint - f.mean(0) * _mean(g, photo_weights)
    return cross / ((f**2).mean(0) * _mean(g**2, photo_weights)).sqrt().clamp_min(1e-30)


@torch.no_grad()
def eigenvalues(f: torch.Tensor) -> torch.Tensor:
    """lambda_l = E[f_l(X)^2] from samples f: (B, L) -> (L,); the learned functions of a
    self-adjoint operator are its eigenfunctions scaled by sqrt(lambda_l)."""
    _check_2d("f", f)
    return (f.to(_compute_dtype(f)) ** 2).mean(0)
