"""Laplacians of importance-weighted functions and the negative Hamiltonian built on them.

The network parameterises f~ = f / sqrt(w) (appendix "Importance Sampling"), so that
<f, T f> = E_{p_train}[f~ (T f) / sqrt(w)]. The operator therefore returns
(f~, (T f) / sqrt(w)) with f = sqrt(w) f~; the ratios sqrt(w(x +- eps e_i) / w(x)) are
formed from log-weights, which keeps them exact where w itself underflows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["LAPLACIANS", "fd_laplacian", "exact_laplacian", "forward_laplacian",
           "negative_hamiltonian"]

Fn = Callable[[torch.Tensor], torch.Tensor]


def fd_laplacian(fn: Fn, log_weight: Fn, x: torch.Tensor, eps: float = 0.01,
                 precision: str = "fp32"):
    """Central differences sum_i (f(x+eps e_i) + f(x-eps e_i) - 2 f(x)) / eps^2 of
    f = sqrt(w) fn, divided by sqrt(w(x)). fn: (N, D) -> (N, L); log_weight: (N, D) ->
    (N,); x: (B, D). Returns (fn(x), laplacian(f)(x) / sqrt(w(x))), both (B, L).

    Only fn(x) keeps its autograd graph: the Laplacian is returned as a constant, as
    every method uses it, so the 2D shifted evaluations are made without one and the
    backward pass runs through the B centres alone. fn may provide
    ``fd_stencil(x, eps) -> (fn(x), fn at x + eps e_i then x - eps e_i: (2D, B, L))``
    (``DisjointMLPs`` does, reusing the centres' Fourier features); otherwise it is
    evaluated at the shifted points. precision: passed to ``fd_stencil`` ("bf16": its
    first layer's feature products in bfloat16); fn without one takes "fp32" only."""
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    B, D = x.shape
    shifts = torch.zeros(2 * D, D, dtype=x.dtype, device=x.device)
    idx = torch.arange(D, device=x.device)
    shifts[idx, idx] = eps
    shifts[D + idx, idx] = -eps
    pts = x.unsqueeze(0) + shifts.unsqueeze(1)  # (2D, B, D): +eps e_i, then -eps e_i
    stencil = getattr(fn, "fd_stencil", None)
    if stencil is not None:
        centre, shifted = stencil(x, eps, precision=precision)
    else:
        if precision != "fp32":
            raise ValueError(f"precision {precision!r} needs a model with fd_stencil")
        centre = fn(x)  # (B, L)
        with torch.no_grad():
            shifted = fn(pts.reshape(-1, D)).reshape(2 * D, B, -1)  # (2D, B, L)
    with torch.no_grad():
        logw = log_weight(torch.cat([x.unsqueeze(0), pts]).reshape(-1, D)).reshape(-1, B)
        ratio = torch.exp(0.5 * (logw[1:] - logw[:1]))  # (2D, B): sqrt(w(x_shift) / w(x))
        neighbours = (ratio.unsqueeze(-1) * shifted).sum(0)  # (B, L)
        lap = (neighbours - 2 * D * centre) / eps**2
    return centre, lap


def exact_laplacian(fn: Fn, log_weight: Fn, x: torch.Tensor, modes: int):
    """The same quantity by autograd (D + 1 backward passes in x). fn must accept one input
    per mode, (L, B, D) -> (B, L), so that d f_l / d x is separate for each mode l.

    As for ``fd_laplacian`` the Laplacian is a constant: its passes build no graph of
    their own and free the network's, and fn(x) is evaluated once more for the caller's
    graph, which then holds the B centres alone (backward through the inputs of the
    first pass would cost a second first-layer product)."""
    L, D = modes, x.shape[1]
    xr = x.detach().unsqueeze(0).expand(L, -1, -1).clone().requires_grad_(True)  # (L, B, D)
    with torch.enable_grad():
        ft = fn(xr)  # (B, L)
        f = ft * torch.exp(0.5 * log_weight(xr)).T  # (B, L), f = sqrt(w) f~ per mode input
        (grad,) = torch.autograd.grad(f.sum(), xr, create_graph=True)  # (L, B, D)
        lap = torch.zeros_like(f)
        for i in range(D):
            (g2,) = torch.autograd.grad(grad[..., i].sum(), xr, retain_graph=i < D - 1)
            lap = lap + g2[..., i].T
    return fn(x), lap * torch.exp(-0.5 * log_weight(x)).unsqueeze(-1)


def forward_laplacian(model, log_weight: Fn, x: torch.Tensor):
    """The same quantity exactly, from the network's own forward-mode derivatives
    (``DisjointMLPs.derivatives``: value, gradient and Laplacian of f~ in one pass) and
    those of the weight: with f = sqrt(w) f~ and l = log w,

        laplacian(f) / sqrt(w) = laplacian f~ + grad l . grad f~ + f~ (laplacian l / 2
                                 + |grad l|^2 / 4),

    l's derivatives by autograd ((B,) values: D cheap backward passes). Returns
    (f~(x) with its graph, the Laplacian as a constant), both (B, L)."""
    centre, grad, lap = model.derivatives(x)  # (B, L), (D, B, L), (B, L)
    D = x.shape[1]
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        (gl,) = torch.autograd.grad(log_weight(xr).sum(), xr, create_graph=True)  # (B, D)
        ll = sum(torch.autograd.grad(gl[:, i].sum(), xr, retain_graph=i < D - 1)[0][:, i]
                 for i in range(D))  # (B,)
    gl, ll = gl.detach(), ll.detach()
    with torch.no_grad():
        lap = lap + torch.einsum("bd,dbl->bl", gl, grad)
        lap = lap + centre.detach() * (0.5 * ll + 0.25 * (gl**2).sum(-1)).unsqueeze(-1)
    return centre, lap


LAPLACIANS = ("fd", "exact", "forward")


def negative_hamiltonian(model, problem, x: torch.Tensor, laplacian: str = "fd", eps: float = 0.01,
                         precision: str = "fp32"):
    """(f~, (T f) / sqrt(w)) at x: (B, D), both (B, L), for T = k laplacian - V + shift
    (k = problem.kinetic).
    f~ keeps its autograd graph; T f is a constant (no graph): the methods use it so.
    precision: the finite-difference stencil's (``fd_laplacian``); "fp32" for "exact"."""
    if laplacian != "fd" and precision != "fp32":
        raise ValueError(f"precision {precision!r} applies to the fd Laplacian only")
    if laplacian == "fd":
        ft, lap = fd_laplacian(model, problem.log_weight, x, eps, precision)
    elif laplacian == "exact":
        ft, lap = exact_laplacian(model, problem.log_weight, x, model.modes)
    elif laplacian == "forward":
        ft, lap = forward_laplacian(model, problem.log_weight, x)
    else:
        raise ValueError(f"laplacian must be one of {LAPLACIANS}, got {laplacian!r}")
    diag = (problem.shift - problem.potential(x)).unsqueeze(-1)  # (B, 1)
    return ft, problem.kinetic * lap + diag * ft.detach()
