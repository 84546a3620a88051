"""Evaluation of learned eigenfunctions on the problem's quadrature (float64), with the
paper's measures, and their values on an image grid for the plots."""

from __future__ import annotations

import copy

import torch

from training.pde import metrics
from training.pde.laplacian import negative_hamiltonian
from training.pde.problems import Problem

__all__ = ["learned_functions", "evaluate", "aligned_on_grid"]


def learned_functions(
    model, problem: Problem, x: torch.Tensor, laplacian="fd", eps=0.01, chunk=512
):
    """(f, T f) at x: (N, D) -> (N, L) each, in float64, where f = sqrt(w) f~ is the
    learned function itself (not its importance-weighted form). Chunked to bound memory."""
    model = copy.deepcopy(model).double().cpu().requires_grad_(False)
    x = x.double().cpu()
    fs, Tfs = [], []
    for xc in x.split(chunk):
        ft, Tft = negative_hamiltonian(model, problem, xc, laplacian, eps)
        sw = torch.exp(0.5 * problem.log_weight(xc)).unsqueeze(-1)  # (n, 1), sqrt(w)
        fs.append((sw * ft).detach())
        Tfs.append((sw * Tft).detach())
    return torch.cat(fs), torch.cat(Tfs)


def evaluate(model, problem: Problem, laplacian="fd", eps=0.01, eval_points=0,
             ritz: torch.Tensor | None = None) -> dict:
    """All measures of the learned modes (see ``metrics.summarize``), plus the rotations
    that align them with the truth, for plotting. ``ritz``: an (L, K) matrix of
    combinations of the modes (``training.pde.ritz``); the combined functions f C, whose
    T f C is (T f) C, are then measured the same way, as result["ritz"]."""
    x, w = problem.quadrature("cpu", eval_points or None)
    f, Tf = learned_functions(model, problem, x, laplacian, eps)
    truth = problem.eigenfunctions(x)
    out = metrics.summarize(f, Tf, truth, w, problem.eigenvalues_true)
    refined = None
    if ritz is not None:
        C = ritz.to(f.dtype)
        refined = metrics.summarize(f @ C, Tf @ C, truth, w, problem.eigenvalues_true)
    out["quadrature"] = problem.quadrature_name
    out["quadrature_points"] = int(x.shape[0])
    n = problem.n_eval
    rot = metrics.procrustes_rotations(f[:, :n], truth, w, out["degenerate_groups"])
    a = metrics.normalize(f, w)
    gram = metrics.inner(a, a, w)  # (L, L), for the orthogonality plot
    norms = metrics.norm_eigenvalues(f[:, :n], w).sqrt()
    return {"metrics": out, "rotations": rot, "gram": gram, "norms": norms, "ritz": refined}


def aligned_on_grid(model, problem: Problem, rotations, norms, half_width, n=96):
    """Learned functions on an n x n image grid, normalised by their quadrature norms and
    rotated as on the quadrature, next to the truth: (n, n, n_eval) each (2D only)."""
    if problem.ndim != 2:
        raise ValueError(f"image grids are for 2D problems, got ndim={problem.ndim}")
    t = torch.linspace(-half_width, half_width, n, dtype=torch.float64)
    xx, yy = torch.meshgrid(t, t, indexing="xy")
    x = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)
    m = copy.deepcopy(model).double().requires_grad_(False)
    k = problem.n_eval
    with torch.no_grad():
        f = m(x)[:, :k] * torch.exp(0.5 * problem.log_weight(x)).unsqueeze(-1) / norms
    f = metrics.apply_rotations(f, rotations)
    return f.reshape(n, n, k), problem.eigenfunctions(x).reshape(n, n, k)
