"""The problems of ``python -m training.pde``, registered by name in ``PROBLEMS``.

Each entry is a factory of keyword options -> ``Problem`` (``training.pde.schrodinger``): a
complete problem, carrying its operator, sampling distribution, evaluation rule, known
spectrum, preset values, grid box and figures. Nothing else in the package looks at a
problem's name.

    hydrogen      the paper's 2D hydrogen-like model (16 modes)
    hydrogen-3d   the hydrogen atom in 3D (14 states, n <= 3)
    oscillator    the isotropic harmonic oscillator in D dimensions (--ndim D; 2D: the paper's)
    schrodinger   your own potential: --potential package.module:function --ndim D

Adding a problem: ``register("name", factory)``, with factory(ndim=..., shift=...) taking
the options it understands (a command-line option the factory does not take is an error).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

from training.pde.hydrogen import hydrogen, hydrogen_3d
from training.pde.oscillator import oscillator
from training.pde.schrodinger import Problem, load_callable, schrodinger

__all__ = ["PROBLEMS", "register", "make_problem", "custom"]


def custom(ndim: int | None = None, potential: str | Callable | None = None,
           kinetic: float | None = None, shift: float | None = None,
           energies: Sequence[float] | None = None,
           eigenfunctions: str | Callable | None = None) -> Problem:
    """The ``schrodinger`` problem of the command line: H = -kinetic laplacian + V with V
    named by ``--potential package.module:function`` (or given as a callable), kinetic 1/2
    and shift 0 unless given; ``--energies`` (ascending) and ``--eigenfunctions
    package.module:function`` score the modes when known."""
    if potential is None:
        raise ValueError("the schrodinger problem needs --potential package.module:function "
                         "(V: x (B, D) -> (B,))")
    if ndim is None:
        raise ValueError("the schrodinger problem needs --ndim D, the dimension of x")
    if isinstance(potential, str):
        potential = load_callable(potential, "--potential")
    if isinstance(eigenfunctions, str):
        eigenfunctions = load_callable(eigenfunctions, "--eigenfunctions")
    return schrodinger(potential, ndim, kinetic=0.5 if kinetic is None else kinetic,
                       shift=0.0 if shift is None else shift, energies=energies or (),
                       eigenfunctions=eigenfunctions, name="schrodinger")


PROBLEMS: dict[str, Callable[..., Problem]] = {
    "hydrogen": hydrogen,
    "hydrogen-3d": hydrogen_3d,
    "oscillator": oscillator,
    "schrodinger": custom,
}


def register(name: str, factory: Callable[..., Problem]) -> None:
    """Add a problem to ``PROBLEMS`` (the command line's PROBLEM choices included)."""
    if not name or name in PROBLEMS:
        raise ValueError(f"problem name {name!r} is empty or taken; taken: {sorted(PROBLEMS)}")
    if not callable(factory):
        raise ValueError(f"the factory of {name!r} must be callable, got {factory!r}")
    PROBLEMS[name] = factory


def make_problem(name: str, ndim: int | None = None, train_std: float | None = None,
                 mix_std: float = 0.0, mix_fraction: float = 0.0,
                 shift: float | None = None, **options) -> Problem:
    """The registered problem ``name`` built with the options given (None: the problem's
    own; ndim, shift and the rest go to its factory, which must take them); then its
    sampling distribution replaced where train_std (a positive std) or a mixture
    (mix_fraction of the samples from N(0, mix_std^2 I)) is given."""
    if name not in PROBLEMS:
        raise ValueError(f"unknown problem {name!r}; choose from {sorted(PROBLEMS)}")
    factory = PROBLEMS[name]
    given = {k: v for k, v in {"ndim": ndim, "shift": shift, **options}.items() if v is not None}
    params = inspect.signature(factory).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        named = [p.name for p in params]
        unknown = sorted(k for k in given if k not in named)
        if unknown:
            raise ValueError(f"{', '.join(unknown)} does not apply to the problem {name!r}; "
                             f"it takes {named}")
    problem = factory(**given)
    if problem.name != name:  # the name it is registered by is the one configs hold
        problem = dataclasses.replace(problem, name=name)
    if train_std is None and mix_fraction == 0:
        return problem
    return problem.with_sampling(train_std, mix_std, mix_fraction)
