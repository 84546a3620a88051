"""The paper's measures of learned eigenfunctions (appendix "Definitions of Reported
Measures"). Functions are given by their values at quadrature points, (N, L), with the
quadrature weights (N,), so <f, g> = sum_n w_n f(x_n) g(x_n); the learned modes are compared
to the true ones in learned order, mode l to the l-th true mode."""

from __future__ import annotations

import math

import torch

__all__ = [
    "inner",
    "normalize",
    "rayleigh_quotients",
    "norm_eigenvalues",
    "relative_errors",
    "degenerate_groups",
    "procrustes_rotations",
    "apply_rotations",
    "procrustes_align",
    "angle_distances",
    "subspace_distances",
    "level_assignment",
    "orthogonality_error",
    "summarize",
]


def inner(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gram matrix <a_i, b_j>: a (N, I), b (N, J), w (N,) -> (I, J)."""
    if a.shape[0] != b.shape[0] or a.shape[0] != w.shape[0]:
        raise ValueError(
            f"point counts differ: a {tuple(a.shape)}, b {tuple(b.shape)}, w {tuple(w.shape)}"
        )
    return a.T @ (w.unsqueeze(-1) * b)


def normalize(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Columns scaled to unit norm: (N, L) -> (N, L)."""
    return a / (w.unsqueeze(-1) * a**2).sum(0).sqrt().clamp_min(1e-300)


def rayleigh_quotients(f: torch.Tensor, Tf: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """<f_l, T f_l> / <f_l, f_l>: (N, L) twice -> (L,). A zero function (the surplus
    modes after ``ritz.nested_modes``) has quotient 0, the eigenvalue its norm stores."""
    wf = w.unsqueeze(-1) * f
    norm = (wf * f).sum(0)
    return torch.where(norm > 0, (wf * Tf).sum(0) / norm.clamp_min(1e-300), 0.0)


def norm_eigenvalues(f: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """<f_l, f_l>, the eigenvalue NestedLoRA stores in the scale of f_l: (N, L) -> (L,)."""
    return (w.unsqueeze(-1) * f**2).sum(0)


def relative_errors(estimate, true) -> torch.Tensor:
    """|estimate - true| / |true| per mode."""
    estimate, true = torch.as_tensor(estimate), torch.as_tensor(true, dtype=torch.float64)
    if estimate.shape != true.shape:
        raise ValueError(f"shapes differ: {tuple(estimate.shape)} vs {tuple(true.shape)}")
    return (estimate.to(true.dtype) - true).abs() / true.abs()


def degenerate_groups(eigenvalues, rtol: float = 1e-9) -> list[list[int]]:
    """Indices of equal consecutive eigenvalues: [1, .5, .5] -> [[0], [1, 2]]."""
    ev = [float(v) for v in eigenvalues]
    groups: list[list[int]] = []
    for i, v in enumerate(ev):
        if groups and math.isclose(v, ev[groups[-1][0]], rel_tol=rtol, abs_tol=rtol):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def procrustes_rotations(learned, truth, w, groups) -> list[tuple[list[int], torch.Tensor]]:
    """Per degenerate subspace g, the orthogonal Omega (|g|, |g|) minimising
    ||a_g Omega - truth_g|| for the normalised learned functions a: Omega = U V^T from the
    SVD U S V^T of <a_g, truth_g> (orthogonal Procrustes in L2)."""
    a = normalize(learned, w)
    out = []
    for g in groups:
        u, _, vh = torch.linalg.svd(inner(a[:, g], truth[:, g], w))
        out.append((g, u @ vh))
    return out


def apply_rotations(a: torch.Tensor, rotations) -> torch.Tensor:
    """Columns of a: (N, L) mixed within each subspace by its rotation: -> (N, L)."""
    out = a.clone()
    for g, omega in rotations:
        out[:, g] = a[:, g] @ omega
    return out


def procrustes_align(learned, truth, w, groups) -> torch.Tensor:
    """Normalised learned functions rotated within each degenerate subspace to best match
    the truth: (N, L) -> (N, L)."""
    rotations = procrustes_rotations(learned, truth, w, groups)
    return apply_rotations(normalize(learned, w), rotations)


def angle_distances(aligned, truth, w) -> torch.Tensor:
    """(2 / pi) arccos |<psi_l, aligned_l>| of normalised functions, in [0, 1]: -> (L,)."""
    c = (inner(normalize(aligned, w), normalize(truth, w), w).diagonal()).abs()
    return (2 / math.pi) * torch.arccos(c.clamp(max=1.0))


def subspace_distances(learned, truth, w, groups) -> torch.Tensor:
    """1 - tr(P Q) / K per degenerate subspace of size K, P and Q the L2 projections onto
    the spans of the learned and true functions of that subspace: -> (len(groups),)."""
    out = []
    for g in groups:
        a, b = learned[:, g], truth[:, g]
        gaa, gbb, gab = inner(a, a, w), inner(b, b, w), inner(a, b, w)
        # tr(P Q) = tr(Gaa^+ Gab Gbb^-1 Gba); the pseudo-inverse projects onto the span of
        # what is there when a learned function is zero (a nested Ritz mode of a negative
        # Ritz value, see ``ritz.nested_modes``)
        tr = torch.trace(torch.linalg.pinv(gaa, hermitian=True) @ gab
                         @ torch.linalg.solve(gbb, gab.T))
        out.append(1 - tr / len(g))
    return torch.stack(out)


def level_assignment(estimates, eigenvalues_true) -> list[int]:
    """For each learned mode, the index of the distinct true eigenvalue (level) nearest to
    its estimate in log scale (levels span orders of magnitude): (L,) -> L ints."""
    levels = sorted({float(v) for v in eigenvalues_true}, reverse=True)
    out = []
    for e in torch.as_tensor(estimates, dtype=torch.float64).tolist():
        if e <= 0:
            out.append(len(levels) - 1)  # below every positive level
            continue
        out.append(min(range(len(levels)), key=lambda j: abs(math.log(e / levels[j]))))
    return out


def orthogonality_error(learned, w) -> torch.Tensor:
    """(1 / L^2) sum_{l,l'} (<psi_l, psi_l'> - delta_ll')^2 of the normalised functions."""
    a = normalize(learned, w)
    g = inner(a, a, w)
    L = g.shape[0]
    return ((g - torch.eye(L, dtype=g.dtype, device=g.device)) ** 2).sum() / L**2


def summarize(f, Tf, truth, w, eigenvalues_true) -> dict:
    """All measures of learned functions f, T f: (N, L) against the known spectrum
    eigenvalues_true (n_eval,) and, when given, the true eigenfunctions truth: (N, n_eval);
    the first n_eval learned modes are evaluated (the rest of a non-compact problem should
    have norm ~0). Measures that need what is not known are None: with no spectrum, the
    quotients, norms and the orthogonality of all L modes remain."""
    n = len(eigenvalues_true)
    if f.shape[1] < n:
        raise ValueError(f"need at least {n} learned modes, got {f.shape[1]}")
    if truth is not None and truth.shape[1] != n:
        raise ValueError(f"{truth.shape[1]} true eigenfunctions for {n} eigenvalues")
    rq = rayleigh_quotients(f, Tf, w)
    norms = norm_eigenvalues(f, w)
    fe = f[:, : n or f.shape[1]]
    out = {
        "eigenvalues_true": [float(v) for v in eigenvalues_true],
        "eigenvalues": rq.tolist(),
        "eigenvalues_norm": norms.tolist(),
        "orthogonality": orthogonality_error(fe, w).item(),
        "rel_errors": None, "rel_error_mean": None, "rel_errors_norm": None,
        "angle_distances": None, "angle_distance_mean": None,
        "subspace_distances": None, "subspace_distance_mean": None,
        "degenerate_groups": None, "modes_in_right_level": None, "order_correct": None,
    }
    if n == 0:
        return out
    ev_true = torch.as_tensor(eigenvalues_true, dtype=torch.float64)
    groups = degenerate_groups(eigenvalues_true)
    rel = relative_errors(rq[:n], ev_true)
    levels = sorted({float(v) for v in eigenvalues_true}, reverse=True)
    expected = [levels.index(float(v)) for v in eigenvalues_true]
    found = level_assignment(rq[:n], eigenvalues_true)
    out.update({
        "rel_errors": rel.tolist(),
        "rel_error_mean": rel.mean().item(),
        "rel_errors_norm": relative_errors(norms[:n], ev_true).tolist(),
        "degenerate_groups": groups,
        # learned order: each mode's Rayleigh quotient lies nearest to its own level
        "modes_in_right_level": sum(a == b for a, b in zip(found, expected, strict=True)),
        "order_correct": found == expected,
    })
    if truth is None:
        return out
    angles = angle_distances(procrustes_align(fe, truth, w, groups), truth, w)
    sub = subspace_distances(fe, truth, w, groups)
    out.update({
        "angle_distances": angles.tolist(),
        "angle_distance_mean": angles.mean().item(),
        "subspace_distances": sub.tolist(),
        "subspace_distance_mean": sub.mean().item(),
    })
    return out
