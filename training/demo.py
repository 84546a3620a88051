"""NestedLoRA on matrices: learn the top-L SVD (or EVD) of a matrix with linear "networks".

A matrix K (n x m) is the operator (T g)(x) = x^T K b between spaces of linear functions
f(x) = a^T x, g(y) = b^T y with <f, f'> = E[f(X) f'(X)] for E[X X^T] = I. Sampling x from
the scaled standard basis sqrt(n) e_i makes every inner product exact, so the optimiser sees
the true objective and the learned a_l, b_l converge to sqrt-scaled singular vectors: the
NestedLoRA optimum is a_l b_l^T = s_l u_l v_l^T, and s_l = ||a_l|| ||b_l||.

    python -m training.demo [--nesting joint|sequential|none] [--L 8] [--steps 3000]
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from tqdm import tqdm

from training import cli
from training.loss import NESTINGS, evd_loss, nesting_masks, svd_loss

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FitConfig:
    L: int = 8  # modes to learn
    nesting: str = "joint"  # joint | sequential | none
    steps: int = 3000
    lr: float = 2e-2
    lr_final: float = 1e-4  # cosine decay to this
    init_scale: float = 0.1
    seed: int = 0


def _basis(n: int, dtype) -> torch.Tensor:
    return n**0.5 * torch.eye(n, dtype=dtype)  # (n, n): rows are samples with E[x x^T] = I


def _optimise(params, loss_fn, cfg: FitConfig, progress: bool) -> list[float]:
    opt = torch.optim.Adam(params, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.steps, eta_min=cfg.lr_final)
    history = []
    for _ in tqdm(range(cfg.steps), disable=not progress, desc=f"NestedLoRA ({cfg.nesting})"):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        sched.step()
        history.append(loss.item())
    return history


def fit_svd(K: torch.Tensor, cfg: FitConfig = FitConfig(), progress: bool = False):
    """Learn the top-L singular triplets of K (n, m) by minimising ``svd_loss``.

    Returns (A (L, n), B (L, m), objective history); left/right singular vectors are the rows
    of A and B up to scale, singular values ||a_l|| ||b_l||.
    """
    n, m = K.shape
    gen = torch.Generator().manual_seed(cfg.seed)
    A = (cfg.init_scale * torch.randn(cfg.L, n, generator=gen, dtype=K.dtype)).requires_grad_()
    B = (cfg.init_scale * torch.randn(cfg.L, m, generator=gen, dtype=K.dtype)).requires_grad_()
    X, Y = _basis(n, K.dtype), _basis(m, K.dtype)
    vm, mm = nesting_masks(cfg.L, cfg.nesting)

    def loss_fn():
        f, g = X @ A.T, Y @ B.T  # (n, L), (m, L): function values at the samples
        Tg = X @ (K @ B.detach().T)  # (n, L): (T g_l)(x) = x^T K b_l
        Tadj_f = Y @ (K.T @ A.detach().T)  # (m, L): (T* f_l)(y) = y^T K^T a_l
        return svd_loss(f, Tg, g, Tadj_f, vm, mm)

    history = _optimise([A, B], loss_fn, cfg, progress)
    return A.detach(), B.detach(), history


def fit_evd(K: torch.Tensor, cfg: FitConfig = FitConfig(), progress: bool = False):
    """Learn the top-L eigenpairs of a symmetric K (n, n) by minimising ``evd_loss``.

    Returns (A (L, n), history); eigenvectors are the rows of A up to scale and the
    eigenvalues ||a_l||^2. Modes beyond the positive part of the spectrum go to zero.
    """
    if K.shape[0] != K.shape[1] or not torch.allclose(K, K.T):
        raise ValueError(f"fit_evd needs a symmetric matrix, got shape {tuple(K.shape)}")
    n = K.shape[0]
    gen = torch.Generator().manual_seed(cfg.seed)
    A = (cfg.init_scale * torch.randn(cfg.L, n, generator=gen, dtype=K.dtype)).requires_grad_()
    # Both halves of the batch are a full basis, so each half-estimate of <f_i, f_j> is exact.
    X = torch.cat([_basis(n, K.dtype), _basis(n, K.dtype)])
    vm, mm = nesting_masks(cfg.L, cfg.nesting)

    def loss_fn():
        return evd_loss(X @ A.T, X @ (K @ A.detach().T), vm, mm)

    history = _optimise([A], loss_fn, cfg, progress)
    return A.detach(), history


def random_matrix(n: int, m: int, s: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """An n x m matrix with singular values ``s`` (len min(n, m)) and random singular vectors."""
    gen = torch.Generator().manual_seed(seed)
    k = s.numel()
    U, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=s.dtype))
    V, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=s.dtype))
    return U @ torch.diag(s) @ V.T


def main(argv=None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> None:
    parser = cli.build_parser(
        FitConfig,
        prog="python -m training.demo",
        description="Recover the SVD of a 64x48 matrix with NestedLoRA.",
        choices={"nesting": NESTINGS},
    )
    cfg = cli.parse(parser, FitConfig, argv)

    s = torch.cat([torch.linspace(1.0, 0.3, 8), torch.linspace(0.25, 0.01, 40)]).double()
    K = random_matrix(64, 48, s, seed=cfg.seed)
    A, B, history = fit_svd(K, cfg, progress=True)

    U, S, Vh = torch.linalg.svd(K)
    sigma = A.norm(dim=1) * B.norm(dim=1)
    cos_u = (A @ U[:, : cfg.L]).diagonal().abs() / A.norm(dim=1)
    cos_v = (B @ Vh[: cfg.L].T).diagonal().abs() / B.norm(dim=1)
    m, _ = nesting_masks(cfg.L, cfg.nesting)
    optimum = -(m * S[: cfg.L] ** 2).sum().item()  # -sum_l m_l s_l^2 at the nested optimum
    print(
        f"NestedLoRA ({cfg.nesting}) on a 64x48 matrix, {cfg.steps} Adam steps, "
        f"final objective {history[-1]:.6f} (optimum {optimum:.6f})"
    )
    print(
        f"{'mode':>4} {'sigma true':>11} {'sigma learned':>14} {'rel err':>9} "
        f"{'|cos u|':>8} {'|cos v|':>8}"
    )
    for l in range(cfg.L):
        rel = abs(sigma[l] - S[l]) / S[l]
        print(
            f"{l + 1:>4} {S[l]:>11.5f} {sigma[l]:>14.5f} {rel:>9.1e} "
            f"{cos_u[l]:>8.5f} {cos_v[l]:>8.5f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
