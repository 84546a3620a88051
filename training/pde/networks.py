"""L disjoint MLPs on random Fourier features, evaluated in one batched computation.

Mode l has its own Fourier matrix B_l (K, D), fixed at initialisation, features
(cos B_l x, sin B_l x, x) of size 2K + D (Tancik et al. 2020), and its own 3-layer softplus
MLP (2K+D) -> H -> H -> 1. The scale convention: B_l = 2 pi kappa times a standard normal
(kappa = ``fourier_scale``), so kappa sets the standard deviation of the angular
frequencies, not their variance. The paper writes N(0, 2 pi kappa); its published code
draws 2 pi kappa randn, and that reading is kept because the variance reading fits the
oscillator worse (docs/operators.md).

The L networks share no parameter (SpIN and NeuralEF need disjoint modes; NeuralSVD uses
sequential nesting for them); their weights are stacked along a leading mode axis so one
bmm evaluates all of them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["DisjointMLPs", "STENCIL_PRECISIONS", "softplus"]


class _Softplus(torch.autograd.Function):
    # softplus(a) = max(a, 0) + log(1 + exp(-|a|)). F.softplus computes log1p, which this
    # CPU build of torch evaluates one element at a time (~9 ns each, 1 ms for the 98K
    # activations of one mode's stencil at batch 128, a fifth of the whole step); log and
    # exp are vectorised, 3.7x faster in all. Accuracy: 1 + exp(-|a|) rounds off terms
    # below 6e-8, so the largest error against float64 is 5e-7, as F.softplus's.
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return torch.relu(a).add_(torch.exp(-a.abs()).add_(1).log_())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return grad * torch.sigmoid(a)  # differentiable: the exact Laplacian differentiates it


def softplus(a: torch.Tensor) -> torch.Tensor:
    """Softplus, elementwise; twice differentiable, as F.softplus (tests/pde/test_networks.py)."""
    return _Softplus.apply(a)


# On the CPU the stencil is evaluated a few modes at a time, a chunk's features staying in
# cache: one mode per chunk at the paper's size (its 1 MB of features; two or four modes
# measured 1-3% slower), but small networks need several, or the step is all per-operation
# overhead (the oscillator's cpu preset, 55 modes of K = 64 at batch 128: 31.6 ms per step
# one mode at a time, 16.1 ms with 8, 16.7 ms with all 55; two threads).
CHUNK_BYTES = 1 << 20
STENCIL_PRECISIONS = ("fp32", "bf16")


class DisjointMLPs(nn.Module):
    """x: (B, D) shared by all modes, or (L, B, D) one input per mode -> (B, L).

    The per-mode input form lets autograd take per-mode derivatives in x in one pass (see
    ``laplacian.exact_laplacian``).
    """

    def __init__(
        self,
        modes: int,
        ndim: int,
        fourier_features: int,
        fourier_scale: float,
        hidden: int,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        for name, value in [
            ("modes", modes),
            ("ndim", ndim),
            ("fourier_features", fourier_features),
            ("hidden", hidden),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not fourier_scale > 0:
            raise ValueError(f"fourier_scale must be positive, got {fourier_scale!r}")
        self.modes, self.ndim = modes, ndim
        L, D, K, H = modes, ndim, fourier_features, hidden
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
        L = self.modes
        if x.dim() == 2:
            x = x.unsqueeze(0).expand(L, -1, -1)  # (L, B, D), a view
        if x.dim() != 3 or x.shape[0] != L or x.shape[2] != self.ndim:
            raise ValueError(
                f"input must be (B, {self.ndim}) or ({L}, B, {self.ndim}), got {tuple(x.shape)}"
            )
        proj = torch.bmm(x, self.freq.to(x.dtype))  # (L, B, K)
        h = torch.cat([torch.cos(proj), torch.sin(proj), x], dim=-1)  # (L, B, 2K+D)
        return self._head(torch.baddbmm(self.b1, h, self.w1))

    def _head(self, a: torch.Tensor, modes: slice = slice(None)) -> torch.Tensor:
        """Layers 2 and 3 of the given modes from their first layer's pre-activation:
        (n, N, H) -> (N, n)."""
        h = softplus(a)
        h = softplus(torch.baddbmm(self.b2[modes], h, self.w2[modes]))  # (n, N, H)
        out = torch.baddbmm(self.b3[modes], h, self.w3[modes])  # (n, N, 1)
        return out.squeeze(-1).T  # (N, n)

    def fd_stencil(
        self, x: torch.Tensor, eps: float, modes_per_product: int | None = None,
        precision: str = "fp32",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The network on the central-difference stencil of x: (B, D) -> (f~(x): (B, L)
        with its autograd graph, f~ at x + eps e_i for i < D then at x - eps e_i:
        (2D, B, L) without one; a finite-difference Laplacian treats those as constants).

        The shifted points' Fourier features are not recomputed. With u = B_l x, v_i =
        eps B_l e_i, c_i = cos v_i and s_i = sin v_i (per feature), the angle-addition
        formulas give the first layer's pre-activation

            a(x +- eps e_i) = [cos u, sin u] @ (c_i * [W_c; W_s])
                              +- [cos u, sin u] @ (s_i * [W_s; -W_c]) + (x +- eps e_i) W_x + b,

        c_i and s_i scaling the weights' rows. Scaling the (2K, H) weights rather than the
        (B, 2K) features keeps that cost independent of the batch, and the trigonometric
        functions are evaluated at the B centres only.

        precision "bf16": the first layer's Fourier-feature products in bfloat16 (fp32
        accumulation): the centres' pre-activation a(x), its weights' gradient, and the
        shifted points' products, formed as differences from a(x):

            a(x +- eps e_i) = a(x) + [cos u, sin u] @ ((c_i - 1) * [W_c; W_s])
                              +- ([cos u, sin u] @ (s_i * [W_s; -W_c]) + eps W_x,i),

        c_i - 1 = -2 sin^2(v_i / 2) (no cancellation). Both products are small, O(eps^2)
        and O(eps), and are needed only to their own relative precision, which bfloat16
        rounding keeps at ~2^-9: the finite differences downstream (fp32, as in the "fp32"
        path) see the shifts to 0.2-0.4%, where a bfloat16 a(x + eps e_i) itself would
        have lost the O(eps^2) difference altogether. On a CPU with AMX these products run
        ~5x faster than in fp32 (benchmarks/pde_bench.py). Everything after the first layer
        stays fp32; the centre's rounding (~2^-9, as in mixed-precision training) enters
        f~ and the gradient alike. For the accuracy it costs, see
        docs/operators.md. Needs float32 parameters.

        modes_per_product: modes evaluated together at the shifted points; None: on the
        CPU as many as keep one chunk's features within ``CHUNK_BYTES`` (one mode at the
        paper's K = 1024, batch 128; 15 of the oscillator's small ones), all of them
        elsewhere (where each product is a kernel launch).
        """
        L, D = self.modes, self.ndim
        if x.dim() != 2 or x.shape[1] != D:
            raise ValueError(f"stencil centres must be (B, {D}), got {tuple(x.shape)}")
        if x.requires_grad:
            raise ValueError("fd_stencil differentiates the parameters only; x requires grad")
        if precision not in STENCIL_PRECISIONS:
            raise ValueError(f"precision must be one of {STENCIL_PRECISIONS}, got {precision!r}")
        B, K = x.shape[0], self.freq.shape[-1]
        m = modes_per_product or (
            max(1, CHUNK_BYTES // (B * (2 * K + D) * x.element_size()))
            if x.device.type == "cpu" else L)
        if precision == "bf16":
            if x.dtype != torch.float32:
                raise ValueError(f"the bf16 stencil is for float32 models, got {x.dtype}")
            return self._fd_stencil_bf16(x, eps, m)
        return self._fd_stencil_fp32(x, eps, m)

    def _fd_stencil_fp32(self, x: torch.Tensor, eps: float, m: int):
        """fd_stencil's precision "fp32" (see there), in chunks of m modes."""
        L, D, H = self.modes, self.ndim, self.w2.shape[-1]
        B, K = x.shape[0], self.freq.shape[-1]
        xl = x.unsqueeze(0).expand(L, -1, -1)  # (L, B, D)
        # In chunks of m modes, through to the output: on the CPU a chunk's features,
        # scaled weights and activations stay in cache, and no large temporary is allocated
        # (on this machine a fresh large tensor costs more in page faults than its fill).
        with torch.no_grad():
            freq, w = self.freq.to(x.dtype), self.w1.detach()  # (L, D, K), (L, 2K+D, H)
            c, s = torch.cos(eps * freq).repeat(1, 1, 2), torch.sin(eps * freq).repeat(1, 1, 2)
            h = x.new_empty(L, B, 2 * K + D)  # the centres' features [cos u, sin u, x]
            h[..., 2 * K :] = xl
            shifted = x.new_empty(2 * D * B, L)  # rows of x + eps e_i, then of x - eps e_i
            for lo in range(0, L, m):
                ls = slice(lo, lo + m)
                u = torch.bmm(xl[ls], freq[ls])  # (n, B, K)
                torch.cos(u, out=h[ls, :, :K])
                torch.sin(u, out=h[ls, :, K : 2 * K])
                trig = h[ls, :, : 2 * K]  # (n, B, 2K)
                w_trig, w_x = w[ls, : 2 * K], w[ls, 2 * K :]  # (n, 2K, H): [W_c; W_s], (n, D, H)
                w_swap = torch.cat([w[ls, K : 2 * K], -w[ls, :K]], 1)  # [W_s; -W_c]
                even = torch.stack(
                    [torch.bmm(trig, w_trig * c[ls, i, :, None]) for i in range(D)], 1
                )  # (n, D, B, H)
                odd = torch.stack(
                    [torch.bmm(trig, w_swap * s[ls, i, :, None]) for i in range(D)], 1
                )
                even += torch.baddbmm(self.b1[ls], xl[ls], w_x).unsqueeze(1)  # + x W_x + b
                odd += eps * w_x.unsqueeze(2)  # + eps e_i W_x
                a = torch.stack([even + odd, even - odd], 1)  # (n, 2, D, B, H)
                shifted[:, ls] = self._head(a.view(a.shape[0], 2 * D * B, H), ls)
        centre = self._head(torch.baddbmm(self.b1, h, self.w1))  # (B, L)
        return centre, shifted.view(2 * D, B, L)

    def _fd_stencil_bf16(self, x: torch.Tensor, eps: float, m: int):
        """fd_stencil's precision "bf16" (see there), in chunks of m modes."""
        L, D, H = self.modes, self.ndim, self.w2.shape[-1]
        B, K = x.shape[0], self.freq.shape[-1]
        xl = x.unsqueeze(0).expand(L, -1, -1)  # (L, B, D)
        with torch.no_grad():
            freq = self.freq.to(x.dtype)  # (L, D, K)
            cm1 = -2 * torch.sin(0.5 * eps * freq) ** 2  # cos(v) - 1: (L, D, K)
            s = torch.sin(eps * freq)  # (L, D, K)
            trig = x.new_empty(L, B, 2 * K, dtype=torch.bfloat16)  # [cos u, sin u], rounded
            u = torch.bmm(xl, freq)  # (L, B, K), in fp32
            torch.cos(u, out=trig[..., :K])
            torch.sin(u, out=trig[..., K:])
            w16 = self.w1[:, : 2 * K].detach().to(torch.bfloat16)  # (L, 2K, H)
            cm1, s, neg_s = (v.to(torch.bfloat16) for v in (cm1, s, -s))
        # the centres' pre-activation: the features' product in bf16, x W_x + b in fp32
        a = _FirstLayerBf16.apply(trig, xl, self.w1, w16) + self.b1  # (L, B, H)
        with torch.no_grad():
            wx = self.w1.detach()[:, 2 * K :]  # (L, D, H)
            a0 = a.detach()
            shifted = x.new_empty(2 * D * B, L)
            for lo in range(0, L, m):
                ls = slice(lo, lo + m)
                n = min(m, L - lo)
                wc, ws = w16[ls, :K], w16[ls, K:]  # (n, K, H) each
                # all 2D difference weights side by side, so one wide product serves them:
                # (c_i - 1) [W_c; W_s] for the even parts, s_i [W_s; -W_c] for the odd
                wd = torch.empty(n, 2 * K, 2 * D, H, dtype=torch.bfloat16, device=x.device)
                for i in range(D):
                    torch.mul(wc, cm1[ls, i, :, None], out=wd[:, :K, i])
                    torch.mul(ws, cm1[ls, i, :, None], out=wd[:, K:, i])
                    torch.mul(ws, s[ls, i, :, None], out=wd[:, :K, D + i])
                    torch.mul(wc, neg_s[ls, i, :, None], out=wd[:, K:, D + i])
                d = torch.bmm(trig[ls], wd.view(n, 2 * K, 2 * D * H)).view(n, B, 2 * D, H)
                even = a0[ls].unsqueeze(1) + d[:, :, :D].transpose(1, 2)  # (n, D, B, H)
                odd = d[:, :, D:].transpose(1, 2).float() + eps * wx[ls].unsqueeze(2)
                pair = torch.stack([even + odd, even - odd], 1)  # (n, 2, D, B, H)
                shifted[:, ls] = self._head(pair.reshape(n, 2 * D * B, H), ls)
        return self._head(a), shifted.view(2 * D, B, L)


    def derivatives(self, x: torch.Tensor, modes_per_product: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The network, its gradient and its Laplacian in x, exactly, in one forward pass:
        x (B, D) -> (f~(x): (B, L) with its autograd graph, grad f~: (D, B, L) and
        laplacian f~: (B, L) without one).

        Forward mode through the layers, with the Fourier features' derivatives in closed
        form: for u = B_l x, d_i [cos u, sin u] = b_i [-sin u, cos u] and laplacian
        [cos u, sin u] = -|b|^2 [cos u, sin u] per feature (|b|^2 summed over the D
        inputs), so the first layer's pre-activation a has

            d_i a = [cos u, sin u] @ (b_i * [W_s; -W_c]) + W_x,i,
            laplacian a = [cos u, sin u] @ (-|b|^2 * [W_c; W_s]),

        D + 1 products beside the centre's where the finite-difference stencil needs 2D;
        then for h = softplus(a): d_i h = s' d_i a and laplacian h = s' laplacian a +
        s'' sum_i (d_i a)^2 (s' = sigmoid, s'' = sigmoid (1 - sigmoid)), and each linear
        layer maps value, gradient and Laplacian alike. modes_per_product: as for
        ``fd_stencil``."""
        L, D = self.modes, self.ndim
        if x.dim() != 2 or x.shape[1] != D or x.requires_grad:
            raise ValueError(f"x must be (B, {D}) without grad, got {tuple(x.shape)}")
        B, K = x.shape[0], self.freq.shape[-1]
        m = modes_per_product or (
            max(1, CHUNK_BYTES // (B * (2 * K + D) * x.element_size()))
            if x.device.type == "cpu" else L)
        xl = x.unsqueeze(0).expand(L, -1, -1)  # (L, B, D)
        with torch.no_grad():
            freq = self.freq.to(x.dtype)  # (L, D, K)
            h = x.new_empty(L, B, 2 * K + D)  # the centres' features [cos u, sin u, x]
            h[..., 2 * K :] = xl
            grad, lap = x.new_empty(D, B, L), x.new_empty(B, L)
            for lo in range(0, L, m):
                ls = slice(lo, lo + m)
                u = torch.bmm(xl[ls], freq[ls])  # (n, B, K)
                torch.cos(u, out=h[ls, :, :K])
                torch.sin(u, out=h[ls, :, K : 2 * K])
                grad[:, :, ls], lap[:, ls] = self._derivatives(h[ls], freq[ls], ls)
        centre = self._head(torch.baddbmm(self.b1, h, self.w1))  # (B, L)
        return centre, grad, lap

    def _derivatives(self, h: torch.Tensor, freq: torch.Tensor, ls: slice):
        """``derivatives`` of the modes ls from their features h (n, B, 2K + D) and
        frequencies (n, D, K): -> (grad (D, B, n), laplacian (B, n))."""
        K, D = freq.shape[-1], freq.shape[1]
        w = self.w1[ls].detach()  # (n, 2K + D, H)
        trig = h[..., : 2 * K]
        w_swap = torch.cat([w[:, K : 2 * K], -w[:, :K]], 1)  # [W_s; -W_c]
        b = freq.repeat(1, 1, 2)  # (n, D, 2K): each frequency for cos and sin rows
        # (n, D, B, H): d_i a, then laplacian a: (n, B, H)
        ga = torch.stack([torch.baddbmm(w[:, 2 * K + i : 2 * K + i + 1], trig,
                                        w_swap * b[:, i, :, None]) for i in range(D)], 1)
        la = torch.bmm(trig, w[:, : 2 * K] * -(b**2).sum(1)[:, :, None])
        a = torch.baddbmm(self.b1[ls], h, w)  # (n, B, H)
        for w_next, b_next in ((self.w2[ls], self.b2[ls]), (self.w3[ls], self.b3[ls])):
            s1 = torch.sigmoid(a)
            s2 = s1 * (1 - s1)
            la = s1 * la + s2 * (ga**2).sum(1)  # the Laplacian of softplus(a)
            ga = s1.unsqueeze(1) * ga
            w_next = w_next.detach()
            a = torch.baddbmm(b_next, softplus(a), w_next)
            ga, la = torch.matmul(ga, w_next.unsqueeze(1)), torch.bmm(la, w_next)
        return ga.squeeze(-1).permute(1, 2, 0), la.squeeze(-1).T


class _FirstLayerBf16(torch.autograd.Function):
    """[cos u, sin u] (L, B, 2K) in bfloat16 and x (L, B, D) against the first layer's
    weights w1 (L, 2K + D, H), whose first 2K rows are also given in bfloat16 (w16):
    -> (L, B, H) in fp32, bias not included. The features' product runs in bfloat16 (fp32
    accumulation; ~5x fp32's rate on AMX), as does its part of the weights' gradient,
    features^T @ grad; x's small product stays fp32. The inputs take no gradient (fixed
    Fourier features; the stencil's x)."""

    @staticmethod
    def forward(ctx, trig: torch.Tensor, x: torch.Tensor, w1: torch.Tensor,
                w16: torch.Tensor) -> torch.Tensor:
        # w16: w1's first 2K rows in bfloat16, converted once by the caller, who needs them
        ctx.save_for_backward(trig, x)
        F = trig.shape[-1]
        return torch.baddbmm(torch.bmm(trig, w16).float(), x, w1[:, F:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        trig, x = ctx.saved_tensors
        F = trig.shape[-1]
        feat = torch.bmm(trig.transpose(1, 2), grad.to(torch.bfloat16))  # (L, 2K, H)
        dw = grad.new_empty(grad.shape[0], F + x.shape[-1], grad.shape[-1])
        try:
            dw[:, :F] = feat
            torch.bmm(x.transpose(1, 2), grad, out=dw[:, F:])
        except RuntimeError:
            # batched gradients (SpIN's is_grads_batched backward) refuse out=: a copy of
            # the (L, 2K + D, H) gradient more
            dw = torch.cat([feat.float(), torch.bmm(x.transpose(1, 2), grad)], 1)
        return None, None, dw, None
