"""Evaluation of learned eigenfunctions on the problem's evaluation rule (float64), with the
paper's measures, and the learned functions aligned with the true ones for the figures."""

from __future__ import annotations

import copy

import torch

from training.pde import metrics
from training.pde.laplacian import negative_hamiltonian
from training.pde.schrodinger import Problem

__all__ = ["learned_functions", "evaluate", "aligned_functions"]


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
    """All measures of the learned modes (see ``metrics.summarize``), plus what aligns
    them with the truth where it is known (``alignment``: rotations and norms, for
    ``aligned_functions``), for the modes as trained and after the Ritz step. ``ritz``: an
    (L, K) matrix of combinations of the modes (``training.pde.ritz``); the combined
    functions f C, whose T f C is (T f) C, are then measured the same way, as
    result["ritz"]."""
    x, w = problem.evaluation_rule("cpu", eval_points or None)
    f, Tf = learned_functions(model, problem, x, laplacian, eps)
    truth = None if problem.eigenfunctions is None else problem.eigenfunctions(x)
    out = metrics.summarize(f, Tf, truth, w, problem.eigenvalues_true)
    refined = None
    if ritz is not None:
        C = ritz.to(f.dtype)
        refined = metrics.summarize(f @ C, Tf @ C, truth, w, problem.eigenvalues_true)
    out["quadrature"] = problem.quadrature_name
    out["quadrature_points"] = int(x.shape[0])
    a = metrics.normalize(f, w)
    gram = metrics.inner(a, a, w)  # (L, L), for the orthogonality plot
    alignment = {"trained": _alignment(f, truth, w, out["degenerate_groups"]),
                 "ritz": None if ritz is None else _alignment(
                     f @ ritz.to(f.dtype), truth, w, out["degenerate_groups"])}
    return {"metrics": out, "gram": gram, "alignment": alignment, "ritz": refined}


def _alignment(f, truth, w, groups):
    """(rotations onto the truth per degenerate level or None, norms (n_eval,)) of the
    first n_eval learned functions f (N, L)."""
    if truth is None:
        return None, None
    n = truth.shape[1]
    norms = metrics.norm_eigenvalues(f[:, :n], w).sqrt()
    return metrics.procrustes_rotations(f[:, :n], truth, w, groups), norms


def aligned_functions(model, problem: Problem, rotations, norms, combination=None,
                      chunk: int = 4096):
    """x (N, D) -> (N, n_eval): the learned functions (times ``combination``, an (L, K)
    matrix such as the Ritz step's, when given) normalised by their quadrature norms and
    rotated within each degenerate level as on the quadrature (``evaluate``)."""
    m = copy.deepcopy(model).double().requires_grad_(False)
    k = problem.n_eval

    def aligned(x: torch.Tensor) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for xc in x.double().split(chunk):  # (the network's activations are L x chunk)
                f = m(xc)
                if combination is not None:
                    f = f @ combination.to(f.dtype)
                out.append(f[:, :k] * torch.exp(0.5 * problem.log_weight(xc)).unsqueeze(-1))
        return metrics.apply_rotations(torch.cat(out) / norms.clamp_min(1e-300), rotations)

    return aligned
