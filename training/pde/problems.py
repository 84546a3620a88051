"""Schrodinger eigenproblems with analytic solutions, registered by name in ``PROBLEMS``.

Each problem is the negative Hamiltonian T = laplacian - V (plus a shift c for non-compact
ones), whose *top* eigenpairs are the physical ground and low excited states. A problem
bundles everything the training and evaluation need and nothing about how to learn it:
the potential, the sampling distribution with its log-density (the importance weight
w(x) = p_train(x) / Lebesgue), the evaluation quadrature, and the analytic spectrum and
eigenfunctions of the modes that are evaluated.

Adding a problem: write a factory ``(ndim) -> Problem`` and register it in ``PROBLEMS``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from training.pde import quadrature

__all__ = ["Problem", "PROBLEMS", "make_problem", "hydrogen", "oscillator"]


@dataclass(frozen=True)
class Problem:
    """A negative-Hamiltonian eigenproblem T f = laplacian f - V f + shift f.

    potential: (B, D) -> (B,), V(x).
    eigenvalues_true: (n_eval,) exact top eigenvalues of T, descending, for the modes that
        are evaluated (the positive ones).
    eigenfunctions: (B, D) -> (B, n_eval), exact orthonormal eigenfunctions (Lebesgue L2).
    train_std: std of the isotropic Gaussian sampling distribution p_train.
    mix_std, mix_fraction: when mix_fraction > 0, p_train is the mixture
        (1 - mix_fraction) N(0, train_std^2 I) + mix_fraction N(0, mix_std^2 I), e.g. a
        narrow component for a cusp at the origin beside a wide one for extended states.
    quadrature: (device) -> (x (N, D), weights (N,)), the evaluation rule for integrals.
    """

    name: str
    ndim: int
    n_modes: int  # L, the number of learned modes by default
    shift: float
    potential: Callable[[torch.Tensor], torch.Tensor]
    eigenvalues_true: tuple[float, ...]
    eigenfunctions: Callable[[torch.Tensor], torch.Tensor]
    train_std: float
    quadrature: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    quadrature_name: str
    plot_half_width: float  # half-width of the square shown in 2D plots
    # paper architecture: random Fourier features (count K, scale kappa) and iterations
    fourier_features: int
    fourier_scale: float
    paper_iterations: int
    mix_std: float = 0.0
    mix_fraction: float = 0.0

    @property
    def n_eval(self) -> int:
        return len(self.eigenvalues_true)

    def _log_gaussian(self, x: torch.Tensor, s: float) -> torch.Tensor:
        return -0.5 * (x**2).sum(-1) / s**2 - self.ndim * math.log(math.sqrt(2 * math.pi) * s)

    def log_weight(self, x: torch.Tensor) -> torch.Tensor:
        """log w(x) = log p_train(x), the Gaussian or the mixture: (B, D) -> (B,)."""
        wide = self._log_gaussian(x, self.train_std)
        a = self.mix_fraction
        if a == 0:
            return wide
        # logsumexp keeps the log-density exact where either component underflows (and,
        # unlike torch.logaddexp, has a finite second derivative for the exact Laplacian)
        narrow = self._log_gaussian(x, self.mix_std)
        return torch.logsumexp(torch.stack([wide + math.log1p(-a), narrow + math.log(a)]), 0)

    def sample(self, n: int, generator: torch.Generator, device, dtype) -> torch.Tensor:
        """n samples of p_train: (n, D). Without a mixture the draws are those of the plain
        Gaussian (runs made before the mixture existed are reproduced)."""
        z = torch.randn(n, self.ndim, generator=generator, dtype=dtype)
        if self.mix_fraction == 0:
            return (self.train_std * z).to(device)
        narrow = torch.rand(n, generator=generator, dtype=dtype) < self.mix_fraction  # (n,)
        std = torch.where(narrow, self.mix_std, self.train_std).to(dtype)
        return (std.unsqueeze(-1) * z).to(device)


# --------------------------------------------------------------------------- hydrogen


def _hyp1f1_terminating(a: int, b: int, z: torch.Tensor) -> torch.Tensor:
    """1F1(a; b; z) for a non-positive integer a, where the series is a polynomial of
    degree -a: sum_k (a)_k / (b)_k z^k / k!."""
    if a > 0:
        raise ValueError(f"the terminating series needs a <= 0, got a={a}")
    out = torch.ones_like(z)
    term = torch.ones_like(z)
    for k in range(-a):
        term = term * (a + k) / ((b + k) * (k + 1)) * z
        out = out + term
    return out


def hydrogen_states(n_max: int) -> list[tuple[int, int]]:
    """(n, l) for n = 0..n_max, l = -n..n, in the order modes are evaluated."""
    return [(n, l) for n in range(n_max + 1) for l in range(-n, n + 1)]


def hydrogen_eigenfunction(n: int, l: int, x: torch.Tensor) -> torch.Tensor:
    """psi_{n,l}(x) of (laplacian + 1/|x|) psi = (2n+1)^-2 psi in 2D: (B, 2) -> (B,).

    Radial part beta (2|l|)!^-1 ((n+|l|)! / ((2n+1)(n-|l|)!))^(1/2) (beta r)^|l|
    exp(-beta r / 2) 1F1(|l|-n; 2|l|+1; beta r), beta = 1/(n+1/2) (Yang et al. 1991), times
    cos(l theta)/sqrt(pi), 1/sqrt(2 pi), sin(|l| theta)/sqrt(pi) for l > 0, 0, < 0.
    """
    if not 0 <= abs(l) <= n:
        raise ValueError(f"need 0 <= |l| <= n, got n={n}, l={l}")
    m = abs(l)
    beta = 1.0 / (n + 0.5)
    r = x.norm(dim=-1)
    theta = torch.atan2(x[..., 1], x[..., 0])
    const = (
        beta
        / math.factorial(2 * m)
        * math.sqrt(math.factorial(n + m) / ((2 * n + 1) * math.factorial(n - m)))
    )
    radial = const * (beta * r) ** m * torch.exp(-beta * r / 2)
    radial = radial * _hyp1f1_terminating(m - n, 2 * m + 1, beta * r)
    if l > 0:
        angular = torch.cos(m * theta) / math.sqrt(math.pi)
    elif l == 0:
        angular = torch.full_like(theta, 1.0 / math.sqrt(2 * math.pi))
    else:
        angular = torch.sin(m * theta) / math.sqrt(math.pi)
    return radial * angular


def hydrogen(ndim: int = 2) -> Problem:
    """2D hydrogen-like atom, T = laplacian + 1/|x|; top 16 modes n = 0..3 with eigenvalues
    (2n+1)^-2 and degeneracy 2n+1."""
    if ndim != 2:
        raise ValueError(f"hydrogen is defined in 2 dimensions, got ndim={ndim}")
    states = hydrogen_states(3)

    def eigenfunctions(x):
        return torch.stack([hydrogen_eigenfunction(n, l, x) for n, l in states], dim=-1)

    return Problem(
        name="hydrogen",
        ndim=2,
        n_modes=len(states),
        shift=0.0,
        potential=lambda x: -1.0 / x.norm(dim=-1),
        eigenvalues_true=tuple(1.0 / (2 * n + 1) ** 2 for n, _ in states),
        eigenfunctions=eigenfunctions,
        train_std=16.0,
        # Functions vanish beyond r ~ 100 (the paper's box [-100, 100]^2); a polar Gauss
        # rule resolves the cusp at the origin that uniform Monte Carlo samples badly.
        quadrature=lambda device, n=None: quadrature.polar_gauss(100.0, device, n),
        quadrature_name="polar Gauss-Legendre on the disk r <= 100",
        plot_half_width=40.0,
        fourier_features=1024,
        fourier_scale=0.1,
        paper_iterations=500_000,
    )


# --------------------------------------------------------------------------- oscillator


def hermite_function(k: int, z: torch.Tensor) -> torch.Tensor:
    """Normalized Hermite function psi_k(z) = (2^k k! sqrt(pi))^-1/2 e^{-z^2/2} H_k(z),
    by the stable three-term recurrence on the normalized functions."""
    p_prev = torch.zeros_like(z)
    p = torch.exp(-(z**2) / 2) / math.pi**0.25
    for j in range(k):
        p, p_prev = math.sqrt(2.0 / (j + 1)) * z * p - math.sqrt(j / (j + 1)) * p_prev, p
    return p


def oscillator_states(ndim: int, n_max: int) -> list[tuple[int, ...]]:
    """Multi-indices (n_1..n_D) with level n = sum n_i <= n_max, by level then lexicographic."""
    out = []
    for level in range(n_max + 1):
        level_states = [
            s for s in itertools.product(range(level + 1), repeat=ndim) if sum(s) == level
        ]
        out.extend(sorted(level_states, reverse=True))
    return out


def oscillator(ndim: int = 2, shift: float | None = None) -> Problem:
    """D-dim harmonic oscillator, T = laplacian - |x|^2 + c with eigenvalues c - 2(n + D/2)
    and degeneracy C(n+D-1, D-1). In 2D: c = 16, 28 positive modes, L = 55 (the paper).
    Elsewhere c = 6 + D: three positive levels, and L also covers the zero level.

    shift: another c (None: those). The evaluated modes are the states of the levels whose
    eigenvalue c - 2(n + D/2) is positive; L stays the default one, which must hold them.
    The paper tunes c (appendix remark "On shifting"): with the default c a level sits at
    exactly 0, where the objective pulls a surplus mode back to norm 0 only cubically."""
    if not isinstance(ndim, int) or ndim < 1:
        raise ValueError(f"ndim must be a positive integer, got {ndim!r}")
    default_levels = 7 if ndim == 2 else 3
    learned_levels = default_levels + 3 if ndim == 2 else default_levels + 1
    n_modes = len(oscillator_states(ndim, learned_levels - 1))
    if shift is None:
        shift = float(2 * default_levels + ndim)  # level n has eigenvalue 2 (levels - n)
    shift = float(shift)
    # levels n with shift - 2 (n + D/2) > 0
    positive_levels = max(0, math.ceil((shift - ndim) / 2))
    if positive_levels < 1:
        raise ValueError(f"shift {shift} leaves no positive eigenvalue (the ground state's is "
                         f"shift - {ndim}); choose shift > {ndim}")
    positive = oscillator_states(ndim, positive_levels - 1)
    if len(positive) > n_modes:
        raise ValueError(f"shift {shift} makes {len(positive)} modes positive, more than the "
                         f"L = {n_modes} learned; choose shift <= {2 * learned_levels + ndim}")

    def eigenfunctions(x):
        # (B, D, n_max+1): 1D Hermite functions per coordinate, then products per state
        h = torch.stack([hermite_function(k, x) for k in range(positive_levels)], dim=-1)
        cols = []
        for s in positive:
            col = torch.ones_like(x[:, 0])
            for d, k in enumerate(s):
                col = col * h[:, d, k]
            cols.append(col)
        return torch.stack(cols, dim=-1)

    if ndim == 2:
        quad = lambda device, n=None: quadrature.box_gauss(5.0, 2, device, n)  # noqa: E731
        quad_name = "Gauss-Legendre on the box [-5, 5]^2"
    else:
        # A grid is infeasible in high dimension: importance sampling from N(0, I), which
        # covers |psi|^2 ~ exp(-|x|^2) poly(x) with bounded weights.
        quad = lambda device, n=None: quadrature.gaussian_mc(1.0, ndim, device, n)  # noqa: E731
        quad_name = "Monte Carlo importance sampling from N(0, I)"

    return Problem(
        name="oscillator",
        ndim=ndim,
        n_modes=n_modes,
        shift=shift,
        potential=lambda x: (x**2).sum(-1),
        eigenvalues_true=tuple(shift - 2 * (sum(s) + ndim / 2) for s in positive),
        eigenfunctions=eigenfunctions,
        # the paper's N(0, 4^2 I) in 2D, N(0, 2^2 I) elsewhere: std 4 leaves too few
        # samples where the states live (|x| < 1.5: 6.8% in 2D, 1.3% in 3D, 0.24% in 4D)
        train_std=4.0 if ndim == 2 else 2.0,
        quadrature=quad,
        quadrature_name=quad_name,
        plot_half_width=5.0,
        fourier_features=256,
        fourier_scale=1.0,
        paper_iterations=100_000,
    )


PROBLEMS: dict[str, Callable[[int], Problem]] = {
    "hydrogen": hydrogen,
    "oscillator": oscillator,
}


def make_problem(name: str, ndim: int | None = None, train_std: float | None = None,
                 mix_std: float = 0.0, mix_fraction: float = 0.0,
                 shift: float | None = None) -> Problem:
    """Build a registered problem; ndim None means the problem's own (2), train_std None
    its own sampling distribution (a positive value replaces the std of p_train).
    mix_fraction > 0 draws that share of the samples from N(0, mix_std^2 I) instead.
    shift: the oscillator's c (None: its own); other problems refuse one."""
    if name not in PROBLEMS:
        raise ValueError(f"unknown problem {name!r}; choose from {sorted(PROBLEMS)}")
    if shift is not None and name != "oscillator":
        raise ValueError(f"a shift applies to the oscillator (a non-compact operator); "
                         f"{name!r} has its own spectrum")
    problem = (PROBLEMS[name](2 if ndim is None else ndim) if shift is None
               else PROBLEMS[name](2 if ndim is None else ndim, shift))
    if train_std is not None:
        if not train_std > 0:
            raise ValueError(f"train_std must be positive, got {train_std!r}")
        problem = dataclasses.replace(problem, train_std=float(train_std))
    if mix_fraction == 0:
        return problem
    if not 0 < mix_fraction < 1:
        raise ValueError(f"mix_fraction must be in [0, 1), got {mix_fraction!r}")
    if not mix_std > 0:
        raise ValueError(f"a mixture (mix_fraction {mix_fraction}) needs mix_std > 0, "
                         f"got {mix_std!r}")
    return dataclasses.replace(problem, mix_std=float(mix_std), mix_fraction=float(mix_fraction))
