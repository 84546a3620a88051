"""The baselines the paper compares NeuralSVD with: NeuralEF (its unbiased-gradient
variant) and SpIN (Cholesky, masked gradient, moving averages). Appendix "In-Depth Review
of SpIN and NeuralEF".

Each is a callable (f~, T f~ / sqrt(w)) -> (surrogate loss, eigenvalue estimates (L,)): the
surrogate is a scalar whose backward puts the method's update direction into the parameter
gradients (it is not the method's objective value). Both need disjoint modes.
"""

from __future__ import annotations

import torch

__all__ = ["NeuralEF", "SpIN"]


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = (x.shape[0] + 1) // 2
    return x[:b], x[b:]


class NeuralEF:
    """Unbiased NeuralEF: with phi the batch-L2-normalised functions, mode l moves along
    4 {-T phi_l + sum_{i<l} <phi_i, T phi_l> phi_i}. The inner products come from the
    other half of the batch, so the product with phi_i(x) stays unbiased."""

    def __init__(self, modes: int):
        self.modes = modes
        self.strict_lower = torch.tril(torch.ones(modes, modes), diagonal=-1)  # i < l

    def __call__(self, ft: torch.Tensor, Tft: torch.Tensor, params=None):
        norm = ft.pow(2).mean(0).sqrt()  # (L,), L2 batch normalisation
        phi = ft / norm  # (B, L), differentiable: the update keeps ||phi_l|| = 1
        Tphi = (Tft / norm).detach()
        p = phi.detach()
        (p1, p2), (t1, t2) = _halves(p), _halves(Tphi)
        mask = self.strict_lower.to(ft)
        # c[i, l] = <phi_i, T phi_l> for i < l, estimated on the opposite half
        c1, c2 = (p2.T @ t2 / len(p2)) * mask.T, (p1.T @ t1 / len(p1)) * mask.T
        grad = torch.cat([-t1 + p1 @ c1, -t2 + p2 @ c2]) * 4  # (B, L)
        loss = (phi * grad).mean(0).sum()
        return loss, (p * Tphi).mean(0)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SpIN:
    """SpIN's masked gradient of tr(Lambda), Lambda = Lc^-1 Pi Lc^-T with Sigma = Lc Lc^T:

        d theta = -2 E[(T phi)^T Lc^-T diag(Lc)^-1 d phi / d theta] + 2 tr(A J),
        A = Lc^-T triu(Lambda diag(Lc)^-1),  J_lm = E[d phi_l / d theta phi_m],

    with Sigma and J replaced by moving averages (decay beta) and Pi by its batch estimate,
    which is unbiased given the averages. J costs L copies of the model, the reason SpIN
    is memory-bound. (tests/pde check the formula against autograd of the masked trace.)
    """

    def __init__(self, modes: int, decay: float = 0.99, jitter: float = 1e-10):
        """jitter: added to Sigma's diagonal before Cholesky, relative to its mean diagonal."""
        if not 0 <= decay < 1:
            raise ValueError(f"SpIN decay must be in [0, 1), got {decay!r}")
        self.modes, self.decay, self.jitter = modes, decay, jitter
        self.sigma: torch.Tensor | None = None  # (L, L) moving average of Sigma
        self.jac: list[torch.Tensor] | None = None  # per parameter (L_m, L_l, ...)

    def _average(self, old, new):
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def __call__(self, ft: torch.Tensor, Tft: torch.Tensor, params):
        params = list(params)
        B, L = ft.shape
        for p in params:
            if p.shape[0] != L:
                raise ValueError(f"SpIN needs per-mode parameters (L={L}, ...), got {p.shape}")
        p_det, Tft = ft.detach(), Tft.detach()
        sigma_hat = p_det.T @ p_det / B
        pi_hat = p_det.T @ Tft / B
        pi_hat = (pi_hat + pi_hat.T) / 2  # Pi is symmetric for self-adjoint T
        # J_m = grad of E[sum_l phi_l sg(phi_m)]: slice l of each parameter holds
        # E[d phi_l / d theta_l phi_m] since the modes share no parameter.
        eye = torch.eye(L, dtype=ft.dtype, device=ft.device)
        # grad_outputs[m, b, l] = phi_m(x_b) / B for every l
        grad_outputs = (p_det.T.unsqueeze(-1) / B).expand(L, B, L)  # (L_m, B, L)
        jac_hat = torch.autograd.grad(
            ft, params, grad_outputs=grad_outputs, retain_graph=True, is_grads_batched=True
        )  # per parameter (L_m, L_l, ...)
        with torch.no_grad():
            self.sigma = self._average(self.sigma, sigma_hat)
            if self.jac is None:
                self.jac = [j.clone() for j in jac_hat]
            else:
                for avg, j in zip(self.jac, jac_hat, strict=True):
                    avg.mul_(self.decay).add_(j, alpha=1 - self.decay)
            chol = self._cholesky(self.sigma, eye)
            chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
            d_inv = torch.diag(1 / torch.diagonal(chol))
            lam = chol_inv @ pi_hat @ chol_inv.T
            A = chol_inv.T @ torch.triu(lam @ d_inv)  # (L, L)
            first = Tft @ chol_inv.T @ d_inv  # (B, L)
            direct = [2 * torch.einsum("ml,ml...->l...", A, j) for j in self.jac]
        loss = -2 * (ft * first).mean(0).sum()
        loss = loss + sum((p * g).sum() for p, g in zip(params, direct, strict=True))
        return loss, torch.diagonal(lam).clone()

    def _cholesky(self, sigma, eye):
        # Sigma can be near-singular early on (small batches, similar modes): add a jitter
        # relative to its scale, growing it until the factorisation succeeds.
        scale = torch.diagonal(sigma).mean()
        jitter = self.jitter
        for _ in range(8):
            chol, info = torch.linalg.cholesky_ex(sigma + jitter * scale * eye)
            if info.item() == 0:
                return chol
            jitter = max(10 * jitter, 1e-8)
        raise ValueError(f"SpIN: the Gram matrix is not positive definite (jitter {jitter:g})")

    def state_dict(self) -> dict:
        return {"sigma": self.sigma, "jac": self.jac}

    def load_state_dict(self, state: dict) -> None:
        self.sigma, self.jac = state["sigma"], state["jac"]
