"""One frozen dataclass of settings for ``python -m training.pde``, its presets and the
command line (training.cli: PROBLEM, then one dashed flag per field). The presets depend on
the problem (the paper used different Fourier features and iteration counts per problem),
so a preset is a function of it."""

from __future__ import annotations

from dataclasses import dataclass

from training import cli
from training.pde.laplacian import LAPLACIANS
from training.pde.methods import METHODS
from training.pde.networks import STENCIL_PRECISIONS
from training.pde.problems import PROBLEMS, Problem, make_problem

__all__ = ["Config", "PRESETS", "batch_size_at", "preset", "problem_of", "parse_args"]


@dataclass(frozen=True)
class Config:
    """Settings of one operator experiment; every field is a dashed flag."""

    problem: str = "hydrogen"
    ndim: int = 2
    method: str = "neuralsvd-seq"
    n_modes: int = 0  # 0: the problem's L (16 hydrogen, 55 for the 2D oscillator)
    iterations: int = 500_000
    batch_size: int = 128
    # the last final_steps steps draw final_batch_size samples instead (0, 0: batch_size
    # throughout): less gradient noise where the lr is small and the modes settle
    final_batch_size: int = 0
    final_steps: int = 0
    lr: float = 1e-4
    lr_floor: float = 0.0  # the cosine schedule decays the lr to lr * lr_floor (0: to zero)
    fourier_features: int = 1024  # K
    fourier_scale: float = 0.1  # kappa
    hidden: int = 128
    laplacian: str = "fd"  # "fd" (central differences) or "exact" (autograd)
    fd_eps: float = 0.01
    # training steps' finite-difference stencil: "fp32", or "bf16" for its first layer's
    # feature products (networks.DisjointMLPs.fd_stencil; ~5x faster on a CPU with AMX)
    stencil_precision: str = "fp32"
    # RMSprop and the EMA in one compiled pass per tensor (training.pde.update; CPU only,
    # torch.compile, a C++ compiler the first time); the same update to float rounding
    fused_update: bool = False
    ema_decay: float = 0.995  # EMA of the parameters, used for evaluation
    spin_decay: float = 0.99  # SpIN's moving averages of Sigma and the Jacobian
    eval_points: int = 0  # 0: the problem's quadrature default
    # a Rayleigh-Ritz step after training (training.pde.ritz) from this many samples of
    # p_train, evaluated beside the modes as trained (metrics.json "ritz"); 0: none
    ritz_samples: int = 0
    train_std: float = 0.0  # std of the sampling distribution p_train; 0: the problem's
    # a second Gaussian N(0, train_mix_std^2 I) drawing this share of the samples; 0: none
    train_mix_fraction: float = 0.0
    train_mix_std: float = 0.0
    # the oscillator's c in T = laplacian - |x|^2 + c; 0: the problem's (16 in 2D)
    shift: float = 0.0
    seed: int = 0
    checkpoint_every: int = 1000
    threads: int = 2  # torch CPU threads
    device: str = "auto"  # "auto": CUDA when present, else CPU
    out: str = "runs/pde"
    resume: bool = False  # continue from OUT/checkpoint.pt (same settings)

    def __post_init__(self):
        choices = {"problem": PROBLEMS, "method": METHODS, "laplacian": LAPLACIANS,
                   "stencil_precision": STENCIL_PRECISIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        for name in ["ndim", "iterations", "batch_size", "fourier_features", "hidden"]:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2, got {self.batch_size}")
        for name in ["lr", "fourier_scale", "fd_eps", "checkpoint_every"]:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.lr_floor < 1:
            raise ValueError(f"lr_floor must be in [0, 1), got {self.lr_floor!r}")
        for name in ["ema_decay", "spin_decay"]:
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.stencil_precision != "fp32" and self.laplacian != "fd":
            raise ValueError(f"stencil_precision {self.stencil_precision!r} applies to the fd "
                             f"Laplacian, not to {self.laplacian!r}")
        if self.ritz_samples < 0 or self.ritz_samples == 1:
            raise ValueError(f"ritz_samples must be 0 (none) or >= 2, got {self.ritz_samples!r}")
        if self.shift < 0:
            raise ValueError(f"shift must be >= 0 (0: the problem's), got {self.shift!r}")
        if self.shift and self.problem != "oscillator":
            raise ValueError(f"shift applies to the oscillator, not to {self.problem!r}")
        if self.train_std < 0:
            raise ValueError(f"train_std must be >= 0, got {self.train_std!r}")
        if not 0 <= self.train_mix_fraction < 1:
            raise ValueError(
                f"train_mix_fraction must be in [0, 1), got {self.train_mix_fraction!r}")
        if self.train_mix_fraction > 0 and not self.train_mix_std > 0:
            raise ValueError(f"train_mix_fraction {self.train_mix_fraction} needs "
                             f"train_mix_std > 0, got {self.train_mix_std!r}")
        if self.final_steps < 0 or self.final_batch_size < 0:
            raise ValueError(f"final_steps and final_batch_size must be >= 0, got "
                             f"{self.final_steps}, {self.final_batch_size}")
        if (self.final_steps > 0) != (self.final_batch_size > 0):
            raise ValueError("final_steps and final_batch_size go together: both > 0 or both 0"
                             f", got {self.final_steps}, {self.final_batch_size}")
        if self.final_batch_size == 1:
            raise ValueError("final_batch_size must be >= 2, got 1")
        if self.n_modes < 0 or self.eval_points < 0:
            raise ValueError(
                f"n_modes and eval_points must be >= 0, got {self.n_modes}, {self.eval_points}"
            )


def problem_of(config: Config) -> Problem:
    """The problem a config trains and is evaluated on (its ndim; its sampling
    distribution when set)."""
    return make_problem(config.problem, config.ndim, config.train_std or None,
                        config.train_mix_std, config.train_mix_fraction,
                        config.shift or None)


def paper(problem: Problem) -> dict:
    """The paper's settings (appendix "Solving Time-Independent Schrodinger Equations")."""
    return dict(
        iterations=problem.paper_iterations,
        batch_size=128,
        lr=1e-4,
        fourier_features=problem.fourier_features,
        fourier_scale=problem.fourier_scale,
        hidden=128,
    )


def cpu(problem: Problem) -> dict:
    """Minutes on 2 CPU cores (hydrogen ~2.5, the 2D oscillator ~6): smaller
    networks and a larger learning rate.

    Hydrogen samples from 0.75 N(0, 16^2 I) + 0.25 N(0, 2^2 I): the wide Gaussian (the
    paper's) reaches the n = 3 states out to r ~ 30, the narrow one puts a quarter of the
    samples on the ground state's cusp, which N(0, 16^2 I) alone samples rarely; and lr
    2e-3. Mean relative eigenvalue error 1.01% and 1.26% for seeds 0 and 1, against 1.83%
    and 3.78% with N(0, 16^2 I) and lr 1e-3.

    The oscillator learns its L (55 in 2D; the 27 surplus modes should come out with norm
    ~0) with kappa = 0.15, so that frequencies ~1 can represent f~ = psi / sqrt(w), a bump of
    width ~1 (at the paper's kappa = 1 every mode shrank to zero); samples from N(0, 2^2 I)
    rather than N(0, 4^2 I), so that a quarter of them, not 7%, fall where the low states
    live; lr 2e-3, batch 128, 18,000 iterations (~5 minutes on 2 threads); and a
    Rayleigh-Ritz step whose nested modes put the surplus directions (negative Ritz
    values) at norm 0 (``training.pde.ritz``). The README's operator section has the runs
    that chose these values.
    """
    values = dict(
        iterations=12_000,
        batch_size=256,
        lr=1e-3,
        fourier_features=64,
        fourier_scale=problem.fourier_scale,
        hidden=64,
    )
    if problem.name == "hydrogen":
        values.update(train_mix_std=2.0, train_mix_fraction=0.25, lr=2e-3,
                      ritz_samples=65_536)
    if problem.name == "oscillator":
        values.update(
            iterations=18_000, batch_size=128, fourier_scale=0.15, lr=2e-3, train_std=2.0,
            ritz_samples=65_536,
        )
    return values


PRESETS = {"paper": paper, "cpu": cpu}
DEFAULT_PRESET = "paper"


def preset(name: str, problem: Problem, **overrides) -> Config:
    """The named preset for a problem, then field overrides (unknown fields or values of
    the wrong type are errors)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {list(PRESETS)}")
    return cli.build(Config, {"problem": problem.name, "ndim": problem.ndim},
                     PRESETS[name](problem), overrides)


def _from_flags(problem: str, **given) -> Config:
    """The config of PROBLEM, ``--preset`` and the other flags given."""
    name = given.pop("preset")
    return preset(name, make_problem(problem, given.get("ndim")), **given)


def parse_args(argv: list[str] | None = None) -> Config:
    """PROBLEM [--preset paper|cpu] and one dashed flag per other Config field."""
    parser = cli.build_parser(
        Config,
        prog="python -m training.pde",
        description="Learn the top eigenfunctions of a Schrodinger operator.",
        presets=PRESETS,
        default_preset=DEFAULT_PRESET,
        choices={"problem": list(PROBLEMS), "method": list(METHODS),
                 "laplacian": list(LAPLACIANS), "stencil_precision": list(STENCIL_PRECISIONS)},
        positional=("problem",),
    )
    return cli.parse(parser, _from_flags, argv)


def batch_size_at(config: Config, step: int) -> int:
    """The samples drawn at ``step`` (0-based): final_batch_size in the last final_steps
    steps, batch_size before. A function of the step alone, so a resumed run draws the
    same batches."""
    if config.final_steps and step >= config.iterations - config.final_steps:
        return config.final_batch_size
    return config.batch_size
