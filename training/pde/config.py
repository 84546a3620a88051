"""One frozen dataclass of settings for ``python -m training.pde``, its presets and the
command line (training.cli: PROBLEM, then one dashed flag per field). A preset is a
function of the problem: the base values here, then those the problem carries
(``Problem.presets``: the paper used different Fourier features and iteration counts per
problem). With no ``--preset`` the device decides: ``cpu`` on a CPU, ``paper`` on CUDA."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from training import cli
from training.device import pick_device
from training.pde.arithmetic import FUSED_UPDATES, STENCIL_SETTINGS
from training.pde.laplacian import LAPLACIANS
from training.pde.methods import METHODS
from training.pde.problems import PROBLEMS, make_problem
from training.pde.schrodinger import Problem

__all__ = ["Config", "PRESETS", "batch_size_at", "preset", "problem_of", "parse_args",
           "choose_preset"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    """Settings of one operator experiment; every field is a dashed flag."""

    problem: str = "hydrogen"
    ndim: int = 0  # 0: the problem's own (2 for hydrogen and the oscillator)
    # the schrodinger problem (your own potential; see training.pde.schrodinger): V as
    # package.module:function, the kinetic coefficient k of H = -k laplacian + V (0: 1/2),
    # known lowest energies of H (ascending) and their eigenfunctions as
    # package.module:function, for the measures
    potential: str = ""
    kinetic: float = 0.0
    energies: list[float] = field(default_factory=list)
    eigenfunctions: str = ""
    preset: str = ""  # the preset these values started from (set by ``preset``)
    method: str = "neuralsvd-seq"
    modes: int = 0  # 0: the problem's L (16 hydrogen, 55 for the 2D oscillator)
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
    # "fd" (central differences, eps fd_eps), "exact" (autograd) or "forward" (exact, the
    # network's forward-mode derivatives: D + 2 products where fd needs 2D + 1)
    laplacian: str = "fd"
    fd_eps: float = 0.01
    # the training steps' finite-difference stencil: "bf16" computes its first layer's
    # feature products in bfloat16 (networks.DisjointMLPs.fd_stencil), "fp32" does not;
    # "auto": bf16 where it is measured faster (training.pde.arithmetic)
    stencil_precision: str = "auto"
    # RMSprop and the EMA in one compiled pass per tensor (training.pde.update; the same
    # update to float rounding): "auto" on a CPU where torch.compile works
    fused_update: str = "auto"
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
    # c in T = c - H (the oscillator's; a problem that takes none refuses it); None: the
    # problem's own (16 for the 2D oscillator)
    shift: float | None = None
    seed: int = 0
    checkpoint_every: int = 1000
    threads: int = 2  # torch CPU threads
    device: str = "auto"  # "auto": CUDA when present, else CPU
    out: str = "runs/pde"
    resume: bool = False  # continue from OUT/checkpoint.pt (same settings)

    def __post_init__(self):
        choices = {"problem": PROBLEMS, "method": METHODS, "laplacian": LAPLACIANS,
                   "stencil_precision": STENCIL_SETTINGS, "fused_update": FUSED_UPDATES,
                   "preset": ("", *PRESETS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        for name in ["iterations", "batch_size", "fourier_features", "hidden"]:
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
        if self.stencil_precision == "bf16" and self.laplacian != "fd":
            raise ValueError(f"stencil_precision {self.stencil_precision!r} applies to the fd "
                             f"Laplacian, not to {self.laplacian!r}")
        if self.ritz_samples < 0 or self.ritz_samples == 1:
            raise ValueError(f"ritz_samples must be 0 (none) or >= 2, got {self.ritz_samples!r}")
        for name in ["ndim", "train_std", "kinetic", "modes", "eval_points"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the problem's), got "
                                 f"{getattr(self, name)!r}")
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


def problem_of(config: Config) -> Problem:
    """The problem a config trains and is evaluated on (its options: ndim, shift, the
    custom potential's; its sampling distribution when set), with a number of modes."""
    problem = make_problem(
        config.problem, ndim=config.ndim or None, train_std=config.train_std or None,
        mix_std=config.train_mix_std, mix_fraction=config.train_mix_fraction,
        shift=config.shift, potential=config.potential or None,
        kinetic=config.kinetic or None, energies=tuple(config.energies) or None,
        eigenfunctions=config.eigenfunctions or None)
    L = config.modes or problem.modes
    if L < 1:
        raise ValueError(f"the problem {problem.name!r} has no number of modes of its own: "
                         f"give --modes L (or --energies)")
    if L < problem.n_eval:
        raise ValueError(f"modes {L} is fewer than the {problem.n_eval} modes "
                         f"{problem.name!r} evaluates")
    return problem


# The paper's settings (appendix "Solving Time-Independent Schrodinger Equations"); a
# problem sets its own Fourier features, scale and iterations (Problem.presets["paper"]).
PAPER = dict(batch_size=128, lr=1e-4, hidden=128, fourier_features=256, fourier_scale=1.0,
             iterations=100_000)
# Minutes on 2 CPU cores: smaller networks, a larger learning rate and a Rayleigh-Ritz step
# (training.pde.ritz); a problem moves what it needs (Problem.presets["cpu"]).
CPU = dict(iterations=12_000, batch_size=256, lr=2e-3, fourier_features=64, hidden=64,
           fourier_scale=0.15, ritz_samples=65_536)


def paper(problem: Problem) -> dict:
    """The paper's settings: K Fourier features and kappa of the problem, 3 x 128 MLPs,
    RMSprop at lr 1e-4, batch 128, the problem's iteration count (500,000 for hydrogen)."""
    return {**PAPER, **problem.presets.get("paper", {})}


def cpu(problem: Problem) -> dict:
    """Minutes on a CPU (on 2 cores, one thread: hydrogen about 5.5, the 10D oscillator 11,
    hydrogen-3d 14; docs/operators.md): K = 64, 3 x 64 MLPs, lr 2e-3, 12,000 steps of 256 and a
    Rayleigh-Ritz step, then the problem's own values (its sampling, kappa, length)."""
    return {**CPU, **problem.presets.get("cpu", {})}


def auto(problem: Problem) -> dict:
    """cpu on a CPU, paper on CUDA (the default)."""
    return PRESETS[choose_preset("auto")[0]](problem)


PRESETS = {"paper": paper, "cpu": cpu}
DEFAULT_PRESET = "auto"


def choose_preset(name: str, device: str = "auto") -> tuple[str, str]:
    """(preset, why): the named one, or for "auto" cpu or paper by the device."""
    if name != "auto":
        return name, f"--preset {name}"
    if pick_device(device).type == "cuda":
        return "paper", "no --preset given and a CUDA device is present"
    return "cpu", ("no --preset given and no CUDA device: the paper preset (hundreds of "
                   "thousands of steps of 3 x 128 MLPs) would take days on a CPU")


def preset(name: str, problem: Problem, **overrides) -> Config:
    """The named preset for a problem, then field overrides (unknown fields or values of
    the wrong type are errors)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {list(PRESETS)}")
    return cli.build(Config, {"problem": problem.name, "preset": name},
                     PRESETS[name](problem), overrides)


def _from_flags(problem: str, **given) -> Config:
    """The config of PROBLEM, ``--preset`` and the other flags given."""
    name, why = choose_preset(given.pop("preset"), given.get("device", "auto"))
    # the problem as the flags define it (its options), whose presets apply
    config = preset(name, problem_of(cli.build(Config, {"problem": problem}, given)), **given)
    log.info("preset %s (%s)", name, why)
    return config


def parse_args(argv: list[str] | None = None) -> Config:
    """PROBLEM [--preset auto|paper|cpu] and one dashed flag per other Config field."""
    parser = cli.build_parser(
        Config,
        prog="python -m training.pde",
        description="Learn the lowest states of a Schrodinger operator H = -k laplacian + V "
                    "(the top eigenfunctions of T = shift - H).",
        presets={"auto": auto, **PRESETS},
        default_preset=DEFAULT_PRESET,
        choices={"problem": list(PROBLEMS), "method": list(METHODS),
                 "laplacian": list(LAPLACIANS), "stencil_precision": list(STENCIL_SETTINGS),
                 "fused_update": list(FUSED_UPDATES)},
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
