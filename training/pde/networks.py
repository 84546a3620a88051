"""L disjoint MLPs on random Fourier features, evaluated in one batched computation.

Mode l has its own Fourier matrix B_l (K, D), fixed at initialisation, features
(cos B_l x, sin B_l x, x) of size 2K + D (Tancik et al. 2020), and its own 3-layer softplus
MLP (2K+D) -> H -> H -> 1. The scale convention: B_l = 2 pi kappa times a standard normal
(kappa = ``fourier_scale``), so kappa sets the standard deviation of the angular
frequencies, not their variance. The paper writes N(0, 2 pi kappa); its published code
draws 2 pi kappa randn, and that reading is kept because the variance reading fits the
oscillator worse (README, operator experiments).

The L networks share no parameter (SpIN and NeuralEF need disjoint modes; NeuralSVD uses
sequential nesting for them); their weights are stacked along a leading mode axis so one
bmm evaluates all of them.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DisjointMLPs"]


class DisjointMLPs(nn.Module):
    """x: (B, D) shared by all modes, or (L, B, D) one input per mode -> (B, L).

    The per-mode input form lets autograd take per-mode derivatives in x in one pass (see
    ``laplacian.exact_laplacian``).
    """

    def __init__(
        self,
        n_modes: int,
        ndim: int,
        fourier_features: int,
        fourier_scale: float,
        hidden: int,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        for name, value in [
            ("n_modes", n_modes),
            ("ndim", ndim),
            ("fourier_features", fourier_features),
            ("hidden", hidden),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not fourier_scale > 0:
            raise ValueError(f"fourier_scale must be positive, got {fourier_scale!r}")
        self.n_modes, self.ndim = n_modes, ndim
        L, D, K, H = n_modes, ndim, fourier_features, hidden
        freq = 2 * math.pi * fourier_scale * torch.randn(L, D, K, generator=generator)
        self.register_buffer("freq", freq)  # (L, D, K), fixed

        def uniform(fan_in, *shape):  # torch.nn.Linear's default initialisation
            bound = 1 / math.sqrt(fan_in)
            return nn.Parameter((2 * torch.rand(*shape, generator=generator) - 1) * bound)

        F_in = 2 * K + D
        self.w1, self.b1 = uniform(F_in, L, F_in, H), uniform(F_in, L, 1, H)
        self.w2, self.b2 = uniform(H, L, H, H), uniform(H, L, 1, H)
        self.w3, self.b3 = uniform(H, L, H, 1), uniform(H, L, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = self.n_modes
        if x.dim() == 2:
            x = x.unsqueeze(0).expand(L, -1, -1)  # (L, B, D), a view
        if x.dim() != 3 or x.shape[0] != L or x.shape[2] != self.ndim:
            raise ValueError(
                f"input must be (B, {self.ndim}) or ({L}, B, {self.ndim}), got {tuple(x.shape)}"
            )
        proj = torch.bmm(x, self.freq.to(x.dtype))  # (L, B, K)
        h = torch.cat([torch.cos(proj), torch.sin(proj), x], dim=-1)  # (L, B, 2K+D)
        h = F.softplus(torch.baddbmm(self.b1, h, self.w1))  # (L, B, H)
        h = F.softplus(torch.baddbmm(self.b2, h, self.w2))  # (L, B, H)
        out = torch.baddbmm(self.b3, h, self.w3)  # (L, B, 1)
        return out.squeeze(-1).T  # (B, L)
