"""Your own operator: a problem registered by name runs end to end; the 2D oscillator
written through the public API is the built-in one (the same training to the bit, the same
measures to the accuracy of the evaluation rules); a bad potential is refused before
training, with a message naming it; the command line's schrodinger problem imports the
potential it is given."""

import json
import math
import re

import pytest
import torch

from tests.pde import potentials
from tests.pde.test_evaluate import _ScaledTruth
from training.pde.__main__ import main
from training.pde.config import preset
from training.pde.evaluate import evaluate
from training.pde.oscillator import oscillator_states
from training.pde.problems import PROBLEMS, make_problem, register
from training.pde.run import run
from training.pde.schrodinger import load_callable, schrodinger

TINY = ["--iterations", "3", "--batch-size", "16", "--fourier-features", "4", "--hidden",
        "8", "--threads", "1", "--ritz-samples", "256", "--fused-update", "false"]


@pytest.fixture
def registry():
    """PROBLEMS as it was, after the test (registering changes a module-level dict)."""
    saved = dict(PROBLEMS)
    yield PROBLEMS
    PROBLEMS.clear()
    PROBLEMS.update(saved)


def _double_well(ndim=2, shift=None):
    """A 2D double well, V = (x^2 - 1)^2 + y^2 / 2, of unknown spectrum, with its own
    presets and no figures."""
    return schrodinger(potentials.double_well, ndim, kinetic=0.5,
                       shift=3.0 if shift is None else shift, modes=4, train_std=1.2,
                       name="double-well", presets={"cpu": {"fourier_scale": 0.3}})


def test_a_registered_problem_is_complete_and_runs(registry, tmp_path, capsys):
    register("double-well", _double_well)
    with pytest.raises(ValueError, match="'double-well' is empty or taken"):
        register("double-well", _double_well)
    assert main(["double-well", "--out", str(tmp_path), *TINY]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["problem"] == "double-well" and m["preset"] == "cpu"
    assert m["config"]["fourier_scale"] == 0.3  # the problem's preset value
    assert len(m["eigenvalues"]) == 4 and m["rel_error_mean"] is None  # no known spectrum
    assert len(m["ritz"]["ritz_values"]) <= 4
    out = capsys.readouterr().out
    assert "double-well neuralsvd-seq (cpu preset)" in out and "eigenvalues " in out
    # the options its factory takes, and only those
    assert make_problem("double-well", shift=2.0).shift == 2.0
    with pytest.raises(ValueError, match="kinetic does not apply to the problem 'double-well'"):
        make_problem("double-well", kinetic=1.0)


def _oscillator_through_the_api(quadrature=None):
    """The built-in 2D oscillator (T = laplacian - |x|^2 + 16, 55 modes, 28 evaluated,
    sampling N(0, 4^2 I)) written with the public API, its eigenfunctions by another
    formula (torch's Hermite polynomials)."""
    states = oscillator_states(2, 6)

    def eigenfunctions(x):
        cols = []
        for a, b in states:
            h = [math.sqrt(1 / (2**k * math.factorial(k) * math.sqrt(math.pi))) for k in (a, b)]
            cols.append(h[0] * torch.special.hermite_polynomial_h(x[:, 0], a)
                        * h[1] * torch.special.hermite_polynomial_h(x[:, 1], b)
                        * torch.exp(-(x**2).sum(-1) / 2))
        return torch.stack(cols, -1)

    return schrodinger(lambda x: (x**2).sum(-1), 2, kinetic=1.0, shift=16.0, modes=55,
                       energies=[2.0 * (a + b + 1) for a, b in states],
                       eigenfunctions=eigenfunctions, train_std=4.0, name="my-oscillator",
                       presets={"cpu": make_problem("oscillator").presets["cpu"]},
                       quadrature=quadrature)


def test_the_oscillator_through_the_public_api_gets_the_builtins_result(registry, tmp_path):
    built_in_rule = make_problem("oscillator").quadrature
    register("my-oscillator", lambda: _oscillator_through_the_api(built_in_rule))
    results = {}
    for name in ("oscillator", "my-oscillator"):
        config = preset("cpu", make_problem(name), iterations=30, batch_size=32, threads=1,
                        fourier_features=8, hidden=16, ritz_samples=4096,
                        fused_update="false", out=str(tmp_path / name))
        results[name] = run(config, progress=False)
    built_in, mine = results["oscillator"], results["my-oscillator"]
    # the same operator, sampling and seed: the same training, to the bit
    a = torch.load(tmp_path / "oscillator" / "checkpoint.pt", weights_only=True)["ema"]
    b = torch.load(tmp_path / "my-oscillator" / "checkpoint.pt", weights_only=True)["ema"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert mine["eigenvalues_true"] == built_in["eigenvalues_true"]
    assert mine["ritz"]["ritz_values"] == built_in["ritz"]["ritz_values"]  # the same samples
    # and the same measures (the eigenfunctions' formulas differ in the last bits)
    for key in ("eigenvalues", "rel_errors", "subspace_distances", "angle_distances"):
        for m, ref in ((mine, built_in), (mine["ritz"], built_in["ritz"])):
            torch.testing.assert_close(torch.tensor(m[key]), torch.tensor(ref[key]),
                                       rtol=1e-8, atol=1e-10)
    # by its own default rule, 2^16 samples of p_train, the exact eigenfunctions (in the
    # network's importance-weighted form) score as exact
    mc = _oscillator_through_the_api()
    assert mc.quadrature_name == "Monte Carlo importance sampling from p_train"
    m = evaluate(_ScaledTruth(mc).double(), mc)["metrics"]
    assert m["rel_error_mean"] < 1e-4 and m["order_correct"]
    assert m["subspace_distance_mean"] < 1e-3 and m["orthogonality"] < 1e-3


@pytest.mark.parametrize("potential,message", [
    (potentials.nan_inside, "potential nan_inside returned NaN or inf at"),
    (potentials.one_column, r"potential one_column returned shape \(1024, 1\) for x of "
                            r"shape \(1024, 2\); it must return shape \(1024,\)"),
    (potentials.numpy_values, "potential numpy_values must return a torch.Tensor, got ndarray"),
    (potentials.broken, "potential broken failed on x of shape \\(1024, 2\\).*KeyError"),
])
def test_a_bad_potential_is_refused_before_training(potential, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message):
        schrodinger(potential, 2, shift=1.0, modes=2)
    # and on the command line, as a usage error naming it, before any training
    name = potential.__name__
    with pytest.raises(SystemExit) as exit_info:
        main(["schrodinger", "--potential", f"tests.pde.potentials:{name}", "--ndim", "2",
              "--modes", "2", "--out", str(tmp_path), *TINY])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err)  # and nothing before it
    assert not (tmp_path / "checkpoint.pt").exists()


def test_bad_eigenfunctions_energies_and_specs_are_refused():
    with pytest.raises(ValueError, match=r"eigenfunctions .* returned shape \(1024, 3\)"):
        schrodinger(potentials.double_well, 2, shift=9.0, energies=[1.0, 2.0],
                    eigenfunctions=lambda x: x.new_zeros(len(x), 3))
    with pytest.raises(ValueError, match=r"energies \[2.5\] are not below the shift 2.0"):
        schrodinger(potentials.double_well, 2, shift=2.0, energies=[1.0, 2.5])
    with pytest.raises(ValueError, match="energies must be ascending"):
        schrodinger(potentials.double_well, 2, shift=9.0, energies=[2.0, 1.0])
    with pytest.raises(ValueError, match="must be package.module:function, got 'nomodule'"):
        load_callable("nomodule")
    with pytest.raises(ValueError, match="cannot import module 'tests.pde.nothing'"):
        load_callable("tests.pde.nothing:f")
    with pytest.raises(ValueError, match="module 'tests.pde.potentials' has no 'absent'"):
        load_callable("tests.pde.potentials:absent")


def test_the_command_line_problem_with_known_energies(tmp_path, capsys):
    """The 1D oscillator H = -1/2 d^2/dx^2 + x^2/2 (energies n + 1/2) named on the command
    line, with its energies and eigenfunctions for the measures."""
    argv = ["schrodinger", "--potential", "tests.pde.potentials:half_harmonic", "--ndim", "1",
            "--shift", "3", "--energies", "0.5", "1.5", "--eigenfunctions",
            "tests.pde.potentials:hermite_1d", "--train-std", "1.5", "--out", str(tmp_path),
            *TINY]
    assert main(argv) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["problem"] == "schrodinger" and m["ndim"] == 1
    assert m["eigenvalues_true"] == [2.5, 1.5] and len(m["eigenvalues"]) == 2
    assert m["subspace_distance_mean"] is not None  # the eigenfunctions were used
    assert m["config"]["potential"] == "tests.pde.potentials:half_harmonic"
    capsys.readouterr()
    for argv, message in [
        (["--ndim", "2"], "needs --potential package.module:function"),
        (["--potential", "tests.pde.potentials:half_harmonic"], "needs --ndim D"),
        (["--potential", "tests.pde.potentials:half_harmonic", "--ndim", "1"],
         "give --modes L (or --energies)"),
        (["--potential", "tests.pde.potentials:nothing", "--ndim", "1"],
         "module 'tests.pde.potentials' has no 'nothing'"),
    ]:
        with pytest.raises(SystemExit):
            main(["schrodinger", *argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err
