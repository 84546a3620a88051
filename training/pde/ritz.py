"""Rayleigh-Ritz refinement of learned eigenfunctions, from samples of p_train alone.

Training leaves each learned mode a little mixed with the others: an excited mode of
hydrogen that holds 0.2% of its squared norm in the ground state, whose eigenvalue is ~40
times its own, has a Rayleigh quotient several per cent too high, although the span of the
modes is accurate. Rayleigh-Ritz keeps the span and fixes the mixing: with the Gram matrix
G = <f_i, f_j> and A = <f_i, T f_j> of the L learned functions, the generalised
eigenproblem A c = theta G c gives the combinations f c_k whose quotients are stationary
within the span. Both matrices are Monte Carlo averages over samples of the training
distribution, in the importance-weighted form that training uses (<f, g> = E_p[f~ g~],
<f, T g> = E_p[f~ (T g) / sqrt(w)]; see ``laplacian``), so no quadrature and no true
eigenfunction enters. The result is a fixed L x L matrix C: the refined functions are the
network's outputs times C, and since T is linear, T (f C) = (T f) C.

Directions of the span with (relative) Gram eigenvalue below ``rcond`` are dropped: a mode
that training left at norm ~0 carries no function to refine.

``nested_modes`` then scales the combinations as NestedLoRA stores its modes: the optimum
of the objective within the span keeps f c_k at squared norm theta_k where theta_k > 0 and
at zero where theta_k <= 0. This is what makes the step apply to the oscillator, whose L
exceeds its positive modes: the surplus directions, whose Ritz values are negative, come
out at norm 0, and what training left of a positive level in a surplus mode (a quotient of
~2 at norm 0.018 in one run) is merged back into that level.
"""

from __future__ import annotations

import copy

import torch

from training.pde.laplacian import negative_hamiltonian
from training.pde.problems import Problem

__all__ = ["ritz_rotation", "nested_modes"]


@torch.no_grad()
def ritz_rotation(model, problem: Problem, n_samples: int, seed: int, laplacian: str = "fd",
                  eps: float = 0.01, chunk: int = 4096, rcond: float = 1e-10
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(theta (K,), C (L, K)): the Ritz values in decreasing order and the combinations of
    the model's L outputs that they belong to (G-orthonormal: C^T G C = I), estimated in
    float64 from ``n_samples`` draws of p_train seeded by ``seed``. K = L unless
    directions fall under ``rcond``."""
    if n_samples < 2:
        raise ValueError(f"n_samples must be >= 2, got {n_samples!r}")
    m = copy.deepcopy(model).double().cpu().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    x = problem.sample(n_samples, gen, "cpu", torch.float64)
    L = m.modes
    A = torch.zeros(L, L, dtype=torch.float64)
    G = torch.zeros(L, L, dtype=torch.float64)
    for xc in x.split(chunk):  # (the exact Laplacian enables its own gradients in x)
        ft, Tft = negative_hamiltonian(m, problem, xc, laplacian, eps)
        ft, Tft = ft.detach(), Tft.detach()
        A += ft.T @ Tft
        G += ft.T @ ft
    A, G = 0.5 * (A + A.T) / n_samples, G / n_samples  # T is self-adjoint
    g_val, g_vec = torch.linalg.eigh(G)
    keep = g_val > g_val.max() * rcond
    whiten = g_vec[:, keep] / g_val[keep].sqrt()  # (L, K): whiten^T G whiten = I
    theta, vec = torch.linalg.eigh(whiten.T @ A @ whiten)
    return theta.flip(0), whiten @ vec.flip(1)


def nested_modes(theta: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """The Ritz combinations C (L, K) scaled as NestedLoRA's optimum within their span:
    column k times sqrt(max(theta_k, 0)), so that f C has squared norms max(theta, 0) and
    the directions of negative (or zero) Ritz value are the zero function."""
    if theta.shape != C.shape[1:]:
        raise ValueError(f"theta {tuple(theta.shape)} does not match C {tuple(C.shape)}")
    return C * theta.clamp(min=0).sqrt()
