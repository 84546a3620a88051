"""The classical cross-check a problem carries where a grid is feasible (``Problem.grid``):
the operator discretised by central finite differences on a cell-centred box (zero
outside), its top eigenpairs by scipy.sparse.linalg.eigsh in shift-invert mode, scored
with the same measures as the neural solvers. The grid has n^D points: it follows the 2D
problems; in 10 dimensions the 120 points per axis of the 2D oscillator's grid would be
6e20 points, 5e21 bytes for one float64 vector."""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.linalg import eigsh

from training.pde import metrics
from training.pde.schrodinger import Problem

__all__ = ["MAX_POINTS", "grid_operator", "solve_grid"]

MAX_POINTS = 4_000_000  # a sparse LU of the shift-invert beyond this is out of reach here


def grid_operator(problem: Problem, half_width: float, n: int):
    """(sparse T (n^D, n^D), points (n^D, D), spacing h) for T = k laplacian - V + shift
    on the box [-half_width, half_width]^D."""
    D = problem.ndim
    if n < 4:
        raise ValueError(f"need at least 4 points per axis, got n={n}")
    if n**D > MAX_POINTS:
        raise ValueError(f"a grid of {n} points per axis in {D} dimensions has {n**D:.3g} "
                         f"points, more than {MAX_POINTS:,}")
    h = 2 * half_width / n
    t = -half_width + (np.arange(n) + 0.5) * h  # cell centres: never on the origin
    lap1 = sp.diags([np.ones(n - 1), -2 * np.ones(n), np.ones(n - 1)], [-1, 0, 1]) / h**2
    lap = sp.csr_matrix((n**D, n**D))
    for d in range(D):  # I x .. x lap1 (axis d) x .. x I
        term = sp.identity(1)
        for e in range(D):
            term = sp.kron(term, lap1 if e == d else sp.identity(n))
        lap = lap + term
    axes = np.meshgrid(*([t] * D), indexing="ij")
    x = torch.as_tensor(np.stack([a.ravel() for a in axes], -1))
    diag = problem.shift - problem.potential(x).numpy()
    return (problem.kinetic * lap + sp.diags(diag)).tocsc(), x, h


def solve_grid(problem: Problem, half_width: float | None = None, n: int | None = None,
               sigma: float | None = None) -> dict:
    """Top n_eval eigenpairs on the problem's grid (``problem.grid``: half-width, points per
    axis; the arguments override it) and the paper's measures against the truth.

    sigma: shift-invert target above the wanted eigenvalues (default 1.1 lambda_1 + 0.1,
    using that the ground-state energy is roughly known)."""
    if problem.grid is None and (half_width is None or n is None):
        raise ValueError(f"the problem {problem.name!r} in {problem.ndim}D carries no grid "
                         f"solver (give half_width and n to use one anyway)")
    if not problem.n_eval:
        raise ValueError(f"the problem {problem.name!r} has no known spectrum to score")
    default_hw, default_n = problem.grid or (half_width, n)
    half_width, n = half_width or default_hw, n or default_n
    k = problem.n_eval
    start = time.perf_counter()
    T, x, h = grid_operator(problem, half_width, n)
    sigma = 1.1 * problem.eigenvalues_true[0] + 0.1 if sigma is None else sigma
    vals, vecs = eigsh(T, k=k, sigma=sigma, which="LM")
    order = np.argsort(-vals)  # descending: the top modes first
    vals, vecs = vals[order], vecs[:, order]
    seconds = time.perf_counter() - start
    cell = h**problem.ndim
    w = torch.full((x.shape[0],), cell, dtype=torch.float64)
    f = torch.as_tensor(vecs / cell**0.5)  # unit L2 norm: sum h^D f^2 = 1
    Tf = torch.as_tensor(T @ vecs / cell**0.5)
    truth = None if problem.eigenfunctions is None else problem.eigenfunctions(x)
    out = metrics.summarize(f, Tf, truth, w, problem.eigenvalues_true)
    out.update(
        {"method": "grid+eigsh", "seconds": seconds, "grid_points": n**problem.ndim,
         "half_width": half_width, "spacing": h, "eigsh_eigenvalues": vals.tolist()}
    )
    return out
