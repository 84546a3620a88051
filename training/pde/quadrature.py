"""Evaluation rules for integrals over R^D: (x (N, D), weights (N,)) with
int g(x) dx ~ sum_i weights_i g(x_i). Built in float64: the metrics compare functions to
1e-6, far below what float32 sums over 1e4 points keep."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["polar_gauss", "box_gauss", "gaussian_mc"]


def _gauss_panels(edges: np.ndarray, per_panel: int) -> tuple[np.ndarray, np.ndarray]:
    nodes, weights = np.polynomial.legendre.leggauss(per_panel)
    xs, ws = [], []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        xs.append(0.5 * (b - a) * nodes + 0.5 * (a + b))
        ws.append(0.5 * (b - a) * weights)
    return np.concatenate(xs), np.concatenate(ws)


def polar_gauss(radius: float, device=None, n: int | None = None):
    """Disk of the given radius in 2D: composite Gauss-Legendre in r on geometric panels
    (resolving functions that vary on scale 1 at the origin and on scale 10 far out) times
    the trapezoid rule in theta (exact for trigonometric polynomials of degree < n_theta).
    n scales the rule (default about 7000 points)."""
    scale = 1 if n is None else max(1, round(math.sqrt(n / 7000)))
    edges = [0.0, 0.5]
    while edges[-1] < radius:
        edges.append(min(2 * edges[-1], radius))
    r, wr = _gauss_panels(np.asarray(edges), 24 * scale)
    n_theta = 32 * scale
    theta = 2 * np.pi * (np.arange(n_theta) + 0.5) / n_theta
    rr, tt = np.meshgrid(r, theta, indexing="ij")
    x = np.stack([rr * np.cos(tt), rr * np.sin(tt)], axis=-1).reshape(-1, 2)
    w = (wr[:, None] * r[:, None] * (2 * np.pi / n_theta) * np.ones_like(tt)).reshape(-1)
    return (
        torch.as_tensor(x, dtype=torch.float64, device=device),
        torch.as_tensor(w, dtype=torch.float64, device=device),
    )


def box_gauss(half_width: float, ndim: int, device=None, n: int | None = None):
    """Tensor-product Gauss-Legendre on [-h, h]^D with about n points (default 96^D in
    2D: exact for polynomials times Gaussians to many digits)."""
    per_dim = 96 if n is None else max(4, round(n ** (1 / ndim)))
    # four panels per axis keep the Gauss nodes dense where the functions oscillate
    edges = np.linspace(-half_width, half_width, 5)
    x1, w1 = _gauss_panels(edges, max(1, per_dim // 4))
    grids = np.meshgrid(*([x1] * ndim), indexing="ij")
    x = np.stack([g.reshape(-1) for g in grids], axis=-1)
    wgrids = np.meshgrid(*([w1] * ndim), indexing="ij")
    w = np.prod(np.stack([g.reshape(-1) for g in wgrids], axis=-1), axis=-1)
    return (
        torch.as_tensor(x, dtype=torch.float64, device=device),
        torch.as_tensor(w, dtype=torch.float64, device=device),
    )


def gaussian_mc(std: float, ndim: int, device=None, n: int | None = None, seed: int = 0):
    """Importance sampling from N(0, std^2 I): weights 1 / (n p(x)). Seeded, so metrics of
    one model are reproducible."""
    n = 2**16 if n is None else n
    gen = torch.Generator().manual_seed(seed)
    x = std * torch.randn(n, ndim, generator=gen, dtype=torch.float64)
    log_p = -0.5 * (x**2).sum(-1) / std**2 - ndim * math.log(math.sqrt(2 * math.pi) * std)
    w = torch.exp(-log_p) / n
    return x.to(device), w.to(device)
