"""The figures a problem carries (``Problem.figures``): its learned functions, normalised
and aligned with the true ones, drawn next to them. Each takes (aligned, problem, out_dir,
label), aligned: (N, D) -> (N, n_eval) float64. matplotlib is imported when one is drawn."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["plane_images", "atom_figures"]


def plane_images(aligned, problem, out_dir, label: str, half_width: float, n: int = 96) -> None:
    """2D problems: learned (aligned) vs analytic on an n x n image of [-h, h]^2, written to
    OUT/eigenfunctions.png."""
    from training.pde import plots

    t = torch.linspace(-half_width, half_width, n, dtype=torch.float64)
    xx, yy = torch.meshgrid(t, t, indexing="xy")
    x = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)
    k = problem.n_eval
    learned = aligned(x).reshape(n, n, k)
    truth = problem.eigenfunctions(x).reshape(n, n, k)
    plots.eigenfunctions(learned, truth, half_width, Path(out_dir) / "eigenfunctions.png",
                         f"{label} (aligned) vs analytic")


def _sphere(n_cos: int = 16, n_phi: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit vectors (M, 3) and weights (M,) of a rule on the sphere (Gauss in cos theta,
    trapezoid in phi), exact for harmonics of degree < 2 n_cos."""
    import numpy as np

    c, wc = np.polynomial.legendre.leggauss(n_cos)
    phi = 2 * np.pi * (np.arange(n_phi) + 0.5) / n_phi
    cc, pp = np.meshgrid(c, phi, indexing="ij")
    s = np.sqrt(1 - cc**2)
    u = np.stack([s * np.cos(pp), s * np.sin(pp), cc], -1).reshape(-1, 3)
    w = (wc[:, None] * (2 * np.pi / n_phi) * np.ones_like(pp)).reshape(-1)
    return torch.as_tensor(u), torch.as_tensor(w)


def radial_parts(fn, states, harmonics, r: torch.Tensor) -> torch.Tensor:
    """R_k(r) = int f_k(r u) Y_k(u) du over the unit sphere for each state k = (n, l,
    orbital) with Y_k = harmonics[(l, orbital)] at unit vectors: (R,) -> (R, K)."""
    u, w = _sphere()
    x = (r[:, None, None] * u[None]).reshape(-1, 3)  # (R * M, 3)
    f = fn(x).reshape(len(r), len(u), -1)  # (R, M, K)
    y = torch.stack([harmonics[(l, o)](u) for _, l, o in states], -1)  # (M, K)
    return torch.einsum("rmk,m,mk->rk", f, w, y)


# the plane through the lobes of each orbital: (the two axes shown)
_PLANE = {"s": (0, 2), "px": (0, 2), "py": (1, 2), "pz": (0, 2), "dxy": (0, 1), "dyz": (1, 2),
          "dz2": (0, 2), "dxz": (0, 2), "dx2-y2": (0, 1)}
_AXES = "xyz"


def atom_figures(aligned, problem, out_dir, label: str, *, states, harmonics) -> None:
    """The 3D atom: OUT/radial.png, r R_nl(r) of each learned state (its projection on its
    own spherical harmonic) against the analytic one, one panel per (n, l); and
    OUT/orbitals.png, slices of the p and d orbitals through their lobes, learned above
    analytic."""
    from training.pde import plots

    r = torch.linspace(1e-3, 30.0, 240, dtype=torch.float64)
    learned = radial_parts(aligned, states, harmonics, r)
    truth = radial_parts(problem.eigenfunctions, states, harmonics, r)
    panels: dict[str, list[int]] = {}
    for k, (n, l, _) in enumerate(states):
        panels.setdefault(f"{n}{'spd'[l]}", []).append(k)
    plots.radial_profiles(r, learned, truth, panels, [o for _, _, o in states],
                          Path(out_dir) / "radial.png", f"{label}: r R_nl(r), learned vs analytic")

    shown = [k for k, (_, l, _) in enumerate(states) if l > 0]
    size = 81
    learned_img, truth_img, extents, titles = [], [], [], []
    for k in shown:
        n, _, orbital = states[k]
        h = 6.0 * n  # the lobes of n = 2 within ~10, of n = 3 within ~18
        t = torch.linspace(-h, h, size, dtype=torch.float64)
        a, b = torch.meshgrid(t, t, indexing="xy")
        x = torch.zeros(size * size, 3, dtype=torch.float64)
        i, j = _PLANE[orbital]
        x[:, i], x[:, j] = a.reshape(-1), b.reshape(-1)
        learned_img.append(aligned(x)[:, k].reshape(size, size))
        truth_img.append(problem.eigenfunctions(x)[:, k].reshape(size, size))
        extents.append(h)
        titles.append(f"{n}{orbital} ({_AXES[i]}{_AXES[j]})")
    plots.slices(learned_img, truth_img, extents, titles, Path(out_dir) / "orbitals.png",
                 f"{label}: p and d orbitals, learned (top) vs analytic (bottom)")
