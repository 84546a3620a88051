"""Each method runs a few steps of a tiny config end to end through the command line and
writes metrics.json, the checkpoint and the plots; bad flags and values are errors."""

import dataclasses
import json
import logging

import pytest
import torch

from training.pde import arithmetic
from training.pde.__main__ import main
from training.pde.config import Config, parse_args

TINY = [
    "--preset", "cpu", "--iterations", "3", "--batch-size", "16", "--fourier-features", "4",
    "--hidden", "8", "--threads", "1", "--checkpoint-every", "2",
]
KEYS = {
    "problem", "method", "iterations", "seconds", "eigenvalues_true", "eigenvalues",
    "rel_errors", "rel_error_mean", "subspace_distance_mean", "orthogonality",
}


@pytest.mark.parametrize("method", ["neuralsvd-seq", "neuralsvd-jnt", "lora", "neuralef", "spin"])
def test_each_method_runs_end_to_end_on_hydrogen(method, tmp_path):
    torch.manual_seed(0)
    assert main(["hydrogen", "--method", method, "--seed", "1", "--out", str(tmp_path),
                 *TINY]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert KEYS <= set(m)
    assert m["problem"] == "hydrogen" and m["method"] == method and m["iterations"] == 3
    assert len(m["eigenvalues"]) == 16 and len(m["rel_errors"]) == 16
    assert all(map(lambda v: v == v, m["eigenvalues"]))  # no NaN
    for name in ("checkpoint.pt", "eigenfunctions.png", "orthogonality.png", "errors.png"):
        assert (tmp_path / name).stat().st_size > 0
    # the hydrogen cpu preset adds a Rayleigh-Ritz step, measured beside the modes as trained
    r = m["ritz"]
    assert r["samples"] == 65_536 and len(r["ritz_values"]) == 16 and len(r["rel_errors"]) == 16
    assert r["ritz_values"] == sorted(r["ritz_values"], reverse=True)


def test_oscillator_in_3d_and_2d_with_the_exact_laplacian(tmp_path, capsys):
    main(["oscillator", "--ndim", "3", "--out", str(tmp_path / "d3"), "--eval-points", "2048",
         "--ritz-samples", "4096", *TINY])
    m = json.loads((tmp_path / "d3" / "metrics.json").read_text())
    # L covers the zero level n = 3 (20 modes); the 10 positive ones are evaluated
    assert m["ndim"] == 3 and len(m["eigenvalues"]) == 20 and len(m["rel_errors"]) == 10
    assert len(m["eigenvalues_norm"]) == 20
    # the nested Ritz modes: squared norms max(theta, 0), so 0 where the Ritz value is not
    # positive (the surplus directions)
    r = m["ritz"]
    assert r["samples"] == 4096 and len(r["eigenvalues_norm"]) == len(r["ritz_values"])
    for norm, theta in zip(r["eigenvalues_norm"], r["ritz_values"], strict=True):
        assert norm == 0.0 if theta <= 0 else norm > 0
    out = capsys.readouterr().out
    assert out.count("largest surplus norm") == 2  # as trained and after the step
    main(["oscillator", "--laplacian", "exact", "--iterations", "2", "--out",
         str(tmp_path / "d2"), "--train-std", "3", "--preset", "paper", *TINY[2:]])
    m = json.loads((tmp_path / "d2" / "metrics.json").read_text())
    assert m["config"]["train_std"] == 3.0 and m["ritz"] is None  # the paper preset has none
    assert len(m["eigenvalues"]) == 55 and len(m["rel_errors"]) == 28  # paper preset


def test_bf16_stencil_trains_end_to_end(tmp_path):
    assert main(["hydrogen", "--stencil-precision", "bf16", "--ritz-samples", "0", "--out",
                 str(tmp_path), *TINY]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["config"]["stencil_precision"] == "bf16" and m["iterations"] == 3
    assert all(v == v for v in m["eigenvalues"])  # evaluated in float64, as always


@pytest.mark.parametrize(
    "argv,message",
    [
        (["hydrogen", "--learning-rate", "1"], "unrecognized arguments: --learning-rate"),
        (["hydrogen", "--method", "pca"], "invalid choice: 'pca'"),
        (["hydrogen", "--preset", "gpu"], "invalid choice: 'gpu'"),
        (["helium"], "invalid choice: 'helium'"),
        (["hydrogen", "--iterations", "many"], "invalid int value: 'many'"),
        (["hydrogen", "--batch-size", "1"], "batch_size must be >= 2, got 1"),
        (["hydrogen", "--ritz-samples", "1"], "ritz_samples must be 0 (none) or >= 2"),
        (["hydrogen", "--ndim", "3"], "ndim=3"),
        (["hydrogen", "--stencil-precision", "fp16"], "invalid choice: 'fp16'"),
        (["hydrogen", "--fused-update", "maybe"], "invalid choice: 'maybe'"),
        (["hydrogen", "--shift", "1"], "shift does not apply to the problem 'hydrogen'"),
        (["hydrogen", "--potential", "math:cos"],
         "potential does not apply to the problem 'hydrogen'"),
        (["hydrogen", "--stencil-precision", "bf16", "--laplacian", "exact"],
         "stencil_precision 'bf16' applies to the fd Laplacian"),
        (["hydrogen", "--batch_size", "512"], "unrecognized arguments: --batch_size"),
        (["hydrogen", "--resume", "maybe"], "argument --resume: expected one of"),
        ([], "the following arguments are required: problem"),
    ],
)
def test_bad_flags_and_values_are_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_presets_and_overrides():
    paper = parse_args(["oscillator", "--preset", "paper"])
    assert (paper.fourier_features, paper.fourier_scale, paper.iterations) == (256, 1.0, 100_000)
    assert paper.lr == 1e-4 and paper.hidden == 128 and paper.preset == "paper"
    h = parse_args(["hydrogen", "--preset", "paper", "--batch-size", "512", "--seed", "3"])
    assert (h.fourier_features, h.iterations, h.batch_size, h.seed) == (1024, 500_000, 512, 3)
    cpu = parse_args(["hydrogen", "--preset", "cpu"])
    assert cpu.iterations < h.iterations and cpu.fourier_features < h.fourier_features
    assert cpu.modes == 0 and cpu.fourier_scale == h.fourier_scale and cpu.lr == 2e-3
    assert paper.modes == 0  # the problem's L = 55
    osc = parse_args(["oscillator", "--preset", "cpu"])
    assert (osc.modes, osc.fourier_scale, osc.lr) == (0, 0.15, 2e-3)
    assert (osc.batch_size, osc.iterations, osc.train_std) == (128, 18_000, 2.0)
    assert osc.ritz_samples == cpu.ritz_samples == 65_536 and paper.ritz_samples == 0
    # fast arithmetic where it is safe is the default of every preset
    assert osc.stencil_precision == paper.stencil_precision == "auto"
    assert osc.fused_update == paper.fused_update == "auto"
    assert cpu.train_std == 0 and paper.train_std == 0  # the problem's: the paper's std
    # hydrogen's cpu preset adds a narrow component for the cusp; the paper samples one Gaussian
    assert (cpu.train_mix_std, cpu.train_mix_fraction) == (2.0, 0.25)
    assert paper.train_mix_fraction == 0 and osc.train_mix_fraction == 0
    assert parse_args(["oscillator", "--preset", "cpu", "--modes", "28"]).modes == 28
    # the problems beyond the paper carry their own cpu preset values
    atom = parse_args(["hydrogen-3d", "--preset", "cpu"])
    assert (atom.fourier_scale, atom.train_mix_std, atom.ritz_samples) == (0.2, 1.5, 65_536)
    ten = parse_args(["oscillator", "--ndim", "10", "--preset", "cpu"])
    assert ten.train_std == 1.0 and atom.laplacian == ten.laplacian == "forward"
    assert cpu.laplacian == osc.laplacian == paper.laplacian == "fd"  # as they were tuned


def test_without_a_preset_the_device_picks_it_and_says_why(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="training.pde")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = parse_args(["hydrogen"])
    assert config.preset == "cpu" and config.iterations == 12_000
    assert "preset cpu (no --preset given and no CUDA device" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_args(["hydrogen"]).preset == "paper"
    assert parse_args(["hydrogen", "--preset", "cpu"]).preset == "cpu"
    # the device given decides, not the one present
    assert parse_args(["hydrogen", "--device", "cpu"]).preset == "cpu"


def test_the_run_says_what_arithmetic_it_chose_and_estimates_its_time(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(arithmetic, "cpu_bf16_units", lambda: ["AVX512-BF16"])
    assert main(["hydrogen", "--out", str(tmp_path), "--ritz-samples", "0", *TINY]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["preset"] == "cpu"
    chosen = m["arithmetic"]["stencil_precision"]["16"]
    assert chosen == {"precision": "bf16", "why": "this CPU has AVX512-BF16"}
    assert m["arithmetic"]["update"] in ("fused, compiled", "torch's RMSprop and EMA")
    est = m["estimate"]
    assert est["train_seconds"] > 0 and est["eval_seconds"] > 0 and "16" in est["step_seconds"]
    log = capsys.readouterr().err  # (the entry point logs to stderr)
    assert "stencil precision bf16 at batch 16 (this CPU has AVX512-BF16)" in log
    # the estimate comes before the first step (the checkpoint of step 2)
    assert log.index("estimated time:") < log.index("trained hydrogen")
    monkeypatch.setattr(arithmetic, "cpu_bf16_units", lambda: [])
    main(["hydrogen", "--out", str(tmp_path / "b"), "--ritz-samples", "0", *TINY])
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert m["arithmetic"]["stencil_precision"]["16"]["precision"] == "fp32"


def test_bool_flags_and_help(capsys):
    assert parse_args(["hydrogen", "--resume", "true"]).resume is True
    assert parse_args(["hydrogen", "--resume"]).resume is True
    assert parse_args(["hydrogen", "--no-resume"]).resume is False
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(Config):
        assert f.name == "problem" or "--" + f.name.replace("_", "-") in out
    assert "--preset" in out and "cpu: Minutes on a CPU (on 2 cores, one thread" in out


def test_the_forward_laplacian_trains_end_to_end_and_keeps_fp32(tmp_path):
    assert main(["hydrogen-3d", "--laplacian", "forward", "--out", str(tmp_path),
                 "--ritz-samples", "512", "--eval-points", "4096", *TINY]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["arithmetic"]["stencil_precision"]["16"]["precision"] == "fp32"
    assert len(m["ritz"]["rel_errors"]) == 14 and all(v == v for v in m["eigenvalues"])
