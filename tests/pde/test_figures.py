"""The figures a problem carries: the atom's radial parts are the analytic R_nl (the
projection on each state's own harmonic, checked along the z axis), and every figure is
written from aligned functions."""

import math

import torch

from training.pde.figures import radial_parts
from training.pde.hydrogen import _SOLID_HARMONICS, atom_states
from training.pde.problems import make_problem


def test_radial_parts_of_the_atom_are_its_radial_functions():
    problem = make_problem("hydrogen-3d")
    states = atom_states(3)
    r = torch.linspace(0.05, 25.0, 40, dtype=torch.float64)
    got = radial_parts(problem.eigenfunctions, states, _SOLID_HARMONICS, r)  # (40, 14)
    on_z = problem.eigenfunctions(torch.stack([0 * r, 0 * r, r], -1))
    for k, (_, l, orbital) in enumerate(states):
        if orbital in ("s", "pz"):  # R_nl(r) = psi(r z) / Y(z)
            y = 0.5 / math.sqrt(math.pi) if l == 0 else math.sqrt(3 / (4 * math.pi))
            torch.testing.assert_close(got[:, k], on_z[:, k] / y, rtol=1e-9, atol=1e-12)
    # 1s: R = 2 e^{-r}, exactly
    torch.testing.assert_close(got[:, 0], 2 * torch.exp(-r), rtol=1e-9, atol=1e-12)


def test_every_problem_draws_its_figures(tmp_path):
    for name, kw, files in [("hydrogen-3d", {}, ["radial.png", "orbitals.png"]),
                            ("oscillator", {}, ["eigenfunctions.png"])]:
        problem = make_problem(name, **kw)
        out = tmp_path / name
        out.mkdir()
        problem.figures(problem.eigenfunctions, problem, out, name)
        for f in files:
            assert (out / f).stat().st_size > 10_000
    assert make_problem("oscillator", 10).figures is None  # nothing to draw in 10D
