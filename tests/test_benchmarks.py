"""Every benchmark script imports and parses its command line (they are run by hand, so a
renamed import would otherwise only show up when someone runs them)."""

import importlib
import json
import pkgutil

import pytest

import benchmarks

NAMES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))


def test_every_benchmark_is_found():
    assert {"cdk_bench", "loss_bench", "pde_bench", "service_bench"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_imports_and_shows_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_similar_class_pairing_draws_and_moments_follow_its_matrix():
    """The levers benchmark's similar-class kernel: T is symmetric, doubly stochastic with
    1 - alpha on the diagonal; the sampler draws the partner class from T (counted over
    many epochs) and joint_moment is E[f(X) g(Y)] written out pair by pair."""
    import numpy as np
    import torch

    from benchmarks.cdk_levers_bench import SimilarClassSampler, similar_class_mixing

    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 4
    T = similar_class_mixing(torch.randn(40, 6, generator=gen), labels, 0.3, 0.2)
    torch.testing.assert_close(T.sum(0), torch.ones(4, dtype=T.dtype))
    torch.testing.assert_close(T.sum(1), torch.ones(4, dtype=T.dtype))
    torch.testing.assert_close(T, T.T)
    torch.testing.assert_close(T.diagonal(), torch.full((4,), 0.7, dtype=T.dtype))

    sketch_labels, photo_labels = np.arange(20) % 4, np.arange(12) % 4
    SimilarClassSampler.T = T
    try:
        sampler = SimilarClassSampler(sketch_labels, photo_labels)
        counts = torch.zeros(4, 4)
        for epoch in range(400):
            for s, p in sampler.epoch(0, epoch, 10):
                counts.index_put_((torch.as_tensor(sketch_labels)[s],
                                   torch.as_tensor(photo_labels)[p]), torch.ones(len(s)),
                                  accumulate=True)
        freq = counts / counts.sum(1, keepdim=True)  # 2,000 draws per class
        assert (freq - T.float()).abs().max() < 0.04
        f, g = torch.randn(20, 3, generator=gen), torch.randn(12, 3, generator=gen)
        want = torch.zeros(3, dtype=torch.float64)
        for i in range(20):
            for j in range(12):
                c, d = sketch_labels[i], photo_labels[j]
                want += f[i].double() * g[j].double() * T[c, d] / (photo_labels == d).sum()
        torch.testing.assert_close(sampler.joint_moment(f, g), want / 20)
    finally:
        SimilarClassSampler.T = None


def test_levers_folds_hold_out_each_non_test_class_once():
    from benchmarks.cdk_levers_bench import folds_of
    from training.cdk.splits import SKETCHY2_TEST

    classes = sorted([f"c{i:03d}" for i in range(104)] + list(SKETCHY2_TEST))
    folds = folds_of({"classes": classes}, "sketchy2", 5, None)
    held = [c for _, parts in folds for c in parts["valid"]]
    assert sorted(held) == [f"c{i:03d}" for i in range(104)]  # each once, no test class
    for _, parts in folds:
        assert len(parts["valid"]) in (20, 21) and len(parts["train"]) == 104 - len(parts["valid"])
        assert not set(parts["train"]) & set(parts["valid"])
    (name, parts), = folds_of({"classes": classes}, "sketchy2", 0, None)
    assert name == "valid" and len(parts["valid"]) == 10


def test_pde_bench_smoke_runs_every_part(tmp_path, capsys):
    """Each part of benchmarks/pde_bench.py on a tiny architecture: step times of every
    method, the cpu preset's runs, the grid solver, the paper-step comparison; and the
    reading of the published code's log."""
    from benchmarks import pde_bench

    pde_bench.main(["--smoke", "--out", str(tmp_path / "all"), "--threads", "1"])
    result = json.loads((tmp_path / "all" / "bench.json").read_text())
    assert set(result["seconds_per_step_paper_arch"]) == {
        f"{m} @ 16" for m in pde_bench.METHODS}
    assert set(result["cpu_preset"]["runs"]) == set(pde_bench.METHODS)
    assert result["grid"]["grid_points"] == 1600
    pde_bench.main(["--smoke", "--paper-step", "--out", str(tmp_path / "step")])
    steps = json.loads((tmp_path / "step" / "paper_step.json").read_text())
    assert set(steps["seconds_per_step"]["16"]) == set(pde_bench.VARIANTS)
    assert "| 16 |" in capsys.readouterr().out
    pde_bench.main(["--smoke", "--preset-steps", "--out", str(tmp_path / "presets")])
    rows = json.loads((tmp_path / "presets" / "preset_steps.json").read_text())
    assert set(rows["oscillator --ndim 10"]) == {"fd", "forward"}
    log = "{'iter': 10, 'loss': 1.0, 'time': 2.5}\n{'iter': 20, 'time': 3.5}\n" \
          "{'iter': 30, 'loss': 0.5, 'time': 4.7}\n"
    assert pde_bench.seconds_from_paper_log(log) == pytest.approx(0.11)
