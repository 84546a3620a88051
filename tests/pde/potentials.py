"""Potentials for the tests of the schrodinger problem, named on its command line as
tests.pde.potentials:NAME: good ones and the mistakes it must refuse."""

import math

import torch


def double_well(x):
    """V = (x_1^2 - 1)^2 + |x_rest|^2 / 2."""
    return (x[:, 0] ** 2 - 1) ** 2 + 0.5 * (x[:, 1:] ** 2).sum(-1)


def half_harmonic(x):
    """V = |x|^2 / 2: with kinetic 1/2 the energies are n + D/2."""
    return 0.5 * (x**2).sum(-1)


def hermite_1d(x):
    """The two lowest eigenfunctions of -1/2 d^2/dx^2 + x^2/2: (B, 1) -> (B, 2)."""
    g = torch.exp(-x[:, 0] ** 2 / 2) / math.pi**0.25
    return torch.stack([g, math.sqrt(2) * x[:, 0] * g], -1)


def nan_inside(x):
    """NaN where |x| < 1: a sqrt of a negative number."""
    return torch.sqrt((x**2).sum(-1) - 1)


def one_column(x):
    return (x**2).sum(-1, keepdim=True)


def numpy_values(x):
    return (x**2).sum(-1).numpy()


def broken(x):
    return {}["coefficient"]
