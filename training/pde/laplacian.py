"""Laplacians of importance-weighted functions and the negative Hamiltonian built on them.

The network parameterises f~ = f / sqrt(w) (appendix "Importance Sampling"), so that
<f, T f> = E_{p_train}[f~ (T f) / sqrt(w)]. The operator therefore returns
(f~, (T f) / sqrt(w)) with f = sqrt(w) f~; the ratios sqrt(w(x +- eps e_i) / w(x)) are
formed from log-weights, which keeps them exact where w itself underflows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["LAPLACIANS", "fd_laplacian", "exact_laplacian", "negative_hamiltonian"]

Fn = Callable[[torch.Tensor], torch.Tensor]


def fd_laplacian(fn: Fn, log_weight: Fn, x: torch.Tensor, eps: float = 0.01):
    """Central differences sum_i (f(x+eps e_i) + f(x-eps e_i) - 2 f(x)) / eps^2 of
    f = sqrt(w) fn, divided by sqrt(w(x)). All 2D+1 stencil points go through fn in one
    call. fn: (N, D) -> (N, L); log_weight: (N, D) -> (N,); x: (B, D).
    Returns (fn(x), laplacian(f)(x) / sqrt(w(x))), both (B, L)."""
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    B, D = x.shape
    shifts = torch.zeros(2 * D + 1, D, dtype=x.dtype, device=x.device)
    idx = torch.arange(D, device=x.device)
    shifts[1 + idx, idx] = eps
    shifts[1 + D + idx, idx] = -eps
    pts = x.unsqueeze(0) + shifts.unsqueeze(1)  # (2D+1, B, D): centre, +eps e_i, -eps e_i
    out = fn(pts.reshape(-1, D)).reshape(2 * D + 1, B, -1)  # (2D+1, B, L)
    logw = log_weight(pts.reshape(-1, D)).reshape(2 * D + 1, B)
    ratio = torch.exp(0.5 * (logw[1:] - logw[:1]))  # (2D, B): sqrt(w(x_shift) / w(x))
    neighbours = (ratio.unsqueeze(-1) * out[1:]).sum(0)  # (B, L)
    lap = (neighbours - 2 * D * out[0]) / eps**2
    return out[0], lap


def exact_laplacian(fn: Fn, log_weight: Fn, x: torch.Tensor, n_modes: int, create_graph=True):
    """The same quantity by autograd (D + 1 backward passes). fn must accept one input per
    mode, (L, B, D) -> (B, L), so that d f_l / d x is separate for each mode l."""
    L = n_modes
    xr = x.detach().unsqueeze(0).expand(L, -1, -1).clone().requires_grad_(True)  # (L, B, D)
    with torch.enable_grad():
        ft = fn(xr)  # (B, L)
        f = ft * torch.exp(0.5 * log_weight(xr)).T  # (B, L), f = sqrt(w) f~ per mode input
        (grad,) = torch.autograd.grad(f.sum(), xr, create_graph=True)  # (L, B, D)
        lap = torch.zeros_like(f)
        D = x.shape[1]
        for i in range(D):
            (g2,) = torch.autograd.grad(
                grad[..., i].sum(), xr, create_graph=create_graph,
                retain_graph=create_graph or i < D - 1,
            )
            lap = lap + g2[..., i].T
    return ft, lap * torch.exp(-0.5 * log_weight(x)).unsqueeze(-1)


LAPLACIANS = ("fd", "exact")


def negative_hamiltonian(
    model, problem, x: torch.Tensor, laplacian: str = "fd", eps: float = 0.01, create_graph=True
):
    """(f~, (T f) / sqrt(w)) at x: (B, D), both (B, L), for T = laplacian - V + shift."""
    if laplacian == "fd":
        ft, lap = fd_laplacian(model, problem.log_weight, x, eps)
    elif laplacian == "exact":
        ft, lap = exact_laplacian(
            model, problem.log_weight, x, model.n_modes, create_graph=create_graph
        )
    else:
        raise ValueError(f"laplacian must be one of {LAPLACIANS}, got {laplacian!r}")
    diag = (problem.shift - problem.potential(x)).unsqueeze(-1)  # (B, 1)
    return ft, lap + diag * ft
