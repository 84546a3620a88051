"""A Schrodinger operator H = -k laplacian + V and everything a solver needs to learn its
lowest states: the public API for your own potential.

The solvers learn the *top* eigenpairs of the negative Hamiltonian T = shift - H
= k laplacian - V + shift, whose eigenvalues shift - E_i are positive for the states wanted
(NestedLoRA stores each eigenvalue as a squared norm). k = 1/2 is the physical kinetic
coefficient in atomic units; the paper's 2D problems use k = 1.

    import torch
    from training.pde.schrodinger import schrodinger

    def double_well(x):  # (B, D) -> (B,)
        return (x[:, 0] ** 2 - 1) ** 2 + 0.5 * (x[:, 1:] ** 2).sum(-1)

    problem = schrodinger(double_well, ndim=2, shift=4.0, modes=6, train_std=1.5)

A ``Problem`` is complete: besides the operator it carries its sampling distribution
(importance weight w = p_train), its evaluation rule, its known spectrum when there is one,
the settings its presets need, the box of its grid solver where a grid is feasible, and its
figures. ``training.pde.problems.register`` makes one a CLI problem; the command line's
``schrodinger`` problem builds one from ``--potential package.module:function``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Problem", "schrodinger", "load_callable", "monte_carlo_rule"]

Fn = Callable[[torch.Tensor], torch.Tensor]
PROBE_POINTS = 1024  # samples of p_train on which a potential is checked before training


@dataclass(frozen=True, kw_only=True)
class Problem:
    """The negative Hamiltonian T f = kinetic laplacian f - V f + shift f and what learning
    and evaluating its top modes need.

    potential: (B, D) -> (B,), V(x).
    eigenvalues_true: (n_eval,) known top eigenvalues of T (shift - E), descending, for the
        modes that are evaluated; () when the spectrum is unknown.
    eigenfunctions: (B, D) -> (B, n_eval), the matching orthonormal eigenfunctions
        (Lebesgue L2), or None: the measures that need them are then left out.
    train_std, mix_std, mix_fraction: p_train = (1 - mix_fraction) N(0, train_std^2 I)
        + mix_fraction N(0, mix_std^2 I) (no mixture when mix_fraction = 0).
    quadrature: (device, n) -> (x (N, D), weights (N,)), the evaluation rule for integrals;
        None: importance sampling from p_train (``monte_carlo_rule``).
    presets: per preset name, the Config values that this problem sets (e.g. its Fourier
        scale, its iteration count); ``training.pde.config`` applies them over its own.
    grid: (half-width, points per axis) of the finite-difference grid solver
        (``training.pde.grid``), or None where a grid is not feasible or not wanted.
    figures: (aligned, problem, out_dir, label) -> None, the problem's own plots of the
        learned functions: aligned(x (N, D)) gives them normalised and rotated onto the true
        ones within each degenerate level, (N, n_eval); None: no such plots.
    """

    name: str
    ndim: int
    potential: Fn
    kinetic: float = 0.5
    shift: float = 0.0
    modes: int = 0  # L learned by default (0: none set; the Config's modes must be)
    eigenvalues_true: tuple[float, ...] = ()
    eigenfunctions: Fn | None = None
    train_std: float = 1.0
    mix_std: float = 0.0
    mix_fraction: float = 0.0
    quadrature: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    quadrature_name: str = "Monte Carlo importance sampling from p_train"
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    grid: tuple[float, int] | None = None
    figures: Callable[..., None] | None = None

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
        Gaussian."""
        z = torch.randn(n, self.ndim, generator=generator, dtype=dtype)
        if self.mix_fraction == 0:
            return (self.train_std * z).to(device)
        narrow = torch.rand(n, generator=generator, dtype=dtype) < self.mix_fraction  # (n,)
        std = torch.where(narrow, self.mix_std, self.train_std).to(dtype)
        return (std.unsqueeze(-1) * z).to(device)

    def evaluation_rule(self, device="cpu", n: int | None = None):
        """(x (N, D), weights (N,)) in float64: the problem's quadrature, else importance
        sampling from p_train with n (default 2^16) points."""
        if self.quadrature is not None:
            return self.quadrature(device, n)
        return monte_carlo_rule(self, device, n)

    def with_sampling(self, train_std: float | None = None, mix_std: float = 0.0,
                      mix_fraction: float = 0.0) -> Problem:
        """The same problem with another p_train: train_std None keeps the std; a mixture
        draws mix_fraction of the samples from N(0, mix_std^2 I)."""
        if train_std is not None and not train_std > 0:
            raise ValueError(f"train_std must be positive, got {train_std!r}")
        if not 0 <= mix_fraction < 1:
            raise ValueError(f"mix_fraction must be in [0, 1), got {mix_fraction!r}")
        if mix_fraction > 0 and not mix_std > 0:
            raise ValueError(f"a mixture (mix_fraction {mix_fraction}) needs mix_std > 0, "
                             f"got {mix_std!r}")
        std = self.train_std if train_std is None else float(train_std)
        out = dataclasses.replace(self, train_std=std, mix_std=float(mix_std) if mix_fraction
                                  else 0.0, mix_fraction=float(mix_fraction))
        check_potential(out)
        return out


def monte_carlo_rule(problem: Problem, device="cpu", n: int | None = None, seed: int = 0):
    """Importance sampling from p_train: weights 1 / (n p_train(x)), float64, seeded (the
    metrics of one model are reproducible)."""
    n = 2**16 if n is None else n
    x = problem.sample(n, torch.Generator().manual_seed(seed), "cpu", torch.float64)
    w = torch.exp(-problem.log_weight(x)) / n
    return x.to(device), w.to(device)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_values(fn, what: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """ValueError naming fn unless fn(x) is a tensor of the given shape, finite."""
    try:
        v = fn(x)
    except Exception as e:  # noqa: BLE001 - re-raised with the function named
        raise ValueError(f"{what} {_name(fn)} failed on x of shape {tuple(x.shape)} "
                         f"({x.dtype}): {type(e).__name__}: {e}") from e
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{what} {_name(fn)} must return a torch.Tensor, got {type(v).__name__}")
    if tuple(v.shape) != shape:
        raise ValueError(f"{what} {_name(fn)} returned shape {tuple(v.shape)} for x of shape "
                         f"{tuple(x.shape)}; it must return shape {shape}")
    bad = ~torch.isfinite(v)
    if bad.any():
        rows = bad.reshape(len(x), -1).any(-1)
        example = x[rows.nonzero()[0, 0]].tolist()
        raise ValueError(f"{what} {_name(fn)} returned NaN or inf at {int(rows.sum())} of "
                         f"{len(x)} points of the training distribution, e.g. x = {example}")


def check_potential(problem: Problem) -> None:
    """Refuse, with a message naming it, a potential (or eigenfunction) that fails, returns
    another shape than (B,) (B, n_eval) or a value that is not finite, at samples of
    p_train in float32 and float64 (what training and evaluation give it)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = problem.sample(PROBE_POINTS, gen, "cpu", dtype)
        _check_values(problem.potential, "potential", x, (PROBE_POINTS,))
        if problem.eigenfunctions is not None and dtype == torch.float64:
            _check_values(problem.eigenfunctions, "eigenfunctions", x,
                          (PROBE_POINTS, problem.n_eval))


def schrodinger(potential: Fn, ndim: int, *, kinetic: float = 0.5, shift: float = 0.0,
                modes: int | None = None, energies: Sequence[float] = (),
                eigenfunctions: Fn | None = None, train_std: float = 1.0,
                mix_std: float = 0.0, mix_fraction: float = 0.0, name: str = "schrodinger",
                quadrature=None, quadrature_name: str | None = None,
                presets: Mapping[str, Mapping[str, Any]] | None = None,
                grid: tuple[float, int] | None = None, figures=None) -> Problem:
    """The problem of H = -kinetic laplacian + potential in ndim dimensions.

    potential: a function of x (B, ndim) -> (B,), called with float32 (training) and
        float64 (evaluation) tensors; checked on samples of p_train here, before training.
    shift: T = shift - H; the states wanted must have energies below it (positive
        eigenvalues of T), and for an unbounded operator the rest of the spectrum should
        lie above it.
    energies: known lowest energies of H, ascending, for the measures (the first
        len(energies) modes are scored against them); eigenfunctions: (B, ndim) ->
        (B, len(energies)), the matching orthonormal eigenfunctions, optional.
    modes: L, the modes learned (default: len(energies)).
    train_std, mix_std, mix_fraction: the sampling distribution of training points.
    quadrature: (device, n) -> (x, weights), the evaluation rule (default: importance
        sampling from p_train). presets, grid, figures: see ``Problem``.
    """
    if not isinstance(ndim, int) or isinstance(ndim, bool) or ndim < 1:
        raise ValueError(f"ndim must be a positive integer, got {ndim!r}")
    if not callable(potential):
        raise ValueError(f"potential must be callable, got {potential!r}")
    if not kinetic > 0:
        raise ValueError(f"kinetic must be positive, got {kinetic!r}")
    energies = tuple(float(e) for e in energies)
    if list(energies) != sorted(energies):
        raise ValueError(f"energies must be ascending (the lowest first), got {list(energies)}")
    too_high = [e for e in energies if not e < shift]
    if too_high:
        raise ValueError(f"energies {too_high} are not below the shift {shift}: T = shift - H "
                         f"must be positive on the states wanted; choose shift > {max(too_high)}")
    if eigenfunctions is not None and not energies:
        raise ValueError("eigenfunctions need their energies (energies=...)")
    L = len(energies) if modes is None else modes
    if not isinstance(L, int) or L < len(energies):
        raise ValueError(f"modes must be an integer >= the {len(energies)} known energies, "
                         f"got {modes!r}")
    if not train_std > 0:
        raise ValueError(f"train_std must be positive, got {train_std!r}")
    problem = Problem(
        name=name, ndim=ndim, potential=potential, kinetic=float(kinetic), shift=float(shift),
        modes=L, eigenvalues_true=tuple(shift - e for e in energies),
        eigenfunctions=eigenfunctions, train_std=float(train_std), quadrature=quadrature,
        quadrature_name=quadrature_name or (
            "Monte Carlo importance sampling from p_train" if quadrature is None else "custom"),
        presets=dict(presets or {}), grid=grid, figures=figures,
    )
    return problem.with_sampling(None, mix_std, mix_fraction)  # (checks the potential)


def load_callable(spec: str, what: str = "--potential") -> Callable:
    """The function named by "package.module:function" (the module imported, the attribute
    looked up); ValueError naming ``what`` and the part that is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must be package.module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable: {fn!r}")
    return fn
