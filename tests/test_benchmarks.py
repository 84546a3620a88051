"""Every benchmark script imports and parses its command line (they are run by hand, so a
renamed import would otherwise only show up when someone runs them), and the training
benchmarks run end to end in their smoke mode on a tiny generated data set."""

import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import benchmarks

NAMES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))
# Benchmarks with a --smoke mode: tiny data, seconds, exit status 0 when the run holds up.
SMOKE = [n for n in NAMES if '"--smoke"' in (Path(benchmarks.__path__[0]) / f"{n}.py").read_text()]


def test_every_benchmark_is_found():
    assert {"cdk_bench", "loss_bench", "pde_bench", "service_bench"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_imports_and_shows_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


# Benchmarks whose smoke mode needs data or arguments: each has a test of its own below
# (test_<name>_smoke...), on generated data.
OWN_TEST = {"cdk_bench", "cdk_finetune_bench", "cdk_levers_bench", "cdk_step_bench",
            "loss_bench", "pde_bench", "scale_bench", "photo_table_bench"}


def test_every_smoke_mode_is_run():
    own = {n for n in OWN_TEST if any(t.startswith(f"test_{n}_smoke") for t in globals())}
    assert own == OWN_TEST <= set(SMOKE)


@pytest.mark.parametrize("name", [n for n in SMOKE if n not in OWN_TEST])
def test_benchmark_runs_in_its_smoke_mode(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--smoke"]) == 0
    assert capsys.readouterr().out  # it reports


def test_the_service_benchmarks_have_a_smoke_mode():
    assert {"service_bench", "encoder_bench", "memory_bench"} <= set(SMOKE)


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
    sampler = SimilarClassSampler(sketch_labels, photo_labels, T)
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


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """7 classes of 4 generated sketch/photo pairs (dark strokes on white; colour fields)
    and a split file naming 2 test classes: 5 others, 2 of which the split holds out for
    validation."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(0)
    classes = [f"class{c}" for c in range(7)]
    for c, name in enumerate(classes):
        for mod in ("sketch", "photo"):
            (root / mod / name).mkdir(parents=True)
        for i in range(4):
            sketch = np.full((40, 40, 3), 255, np.uint8)
            r = int(rng.integers(4, 30))
            sketch[r : r + 3, 4 + c : 36] = 0
            sketch[4:36, (r + 5 * c) % 34 : (r + 5 * c) % 34 + 3] = 0
            photo = (rng.random((40, 40, 3)) * 60).astype(np.uint8)
            photo[..., c % 3] += 40 * (1 + c // 3)
            Image.fromarray(sketch).save(root / "sketch" / name / f"{name}{i}-1.png")
            Image.fromarray(photo).save(root / "photo" / name / f"{name}{i}.png")
    split = root / "split.txt"
    split.write_text("class5\nclass6\n")
    return root, split


def test_loss_bench_smoke(capsys):
    from benchmarks import loss_bench

    loss_bench.main(["--smoke", "--device", "cpu"])
    assert capsys.readouterr().out.count("speed-up") == 2  # CDK and EVD


def test_cdk_bench_smoke(tiny_data, tmp_path, capsys):
    from benchmarks import cdk_bench

    root, split = tiny_data
    assert cdk_bench.main(["--smoke", "--data", str(root), "--split", str(split), "--out",
                           str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text()
    for row in ("(b) lora", "(c) neuralsvd-seq", "(d) neuralsvd-jnt"):
        assert row in table


def test_cdk_finetune_bench_smoke(tiny_data, tmp_path):
    from benchmarks import cdk_finetune_bench

    root, split = tiny_data
    assert cdk_finetune_bench.main(["--smoke", "--data", str(root), "--split", str(split),
                                    "--out", str(tmp_path), "--variants", "frozen-lite0",
                                    "finetune-lite0"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["frozen-lite0", "finetune-lite0"]
    assert [r["config"]["finetune"] for r in rows] == [False, True]
    assert {r["config"]["backbone"] for r in rows} == {"efficientnet-lite0"}


def test_cdk_step_bench_smoke(tiny_data, capsys):
    from benchmarks import cdk_step_bench

    root, split = tiny_data
    cdk_step_bench.main(["--smoke", "--data", str(root), "--split", str(split), "--batches",
                         "4", "--stages", "1", "--steps", "1", "--warmup", "0",
                         "--cache-images", "4"])
    out = capsys.readouterr().out
    assert out.count("trunk cache") == 1 and out.count("trunk no_grad + aug") == 3


def test_cdk_levers_bench_smoke(tiny_data, tmp_path, capsys):
    from benchmarks import cdk_levers_bench

    root, split = tiny_data
    variants = ["preset", "preset, similar-class pairing 0.3", "preset, nesting weights 1/l^2"]
    assert cdk_levers_bench.main(["--smoke", "--data", str(root), "--split", str(split),
                                  "--out", str(tmp_path), "--threads", "1",
                                  "--variants", *variants]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == variants
    # the variants passed their own sampler and weights: different training, same data
    assert len({r["max_swap_top32"] for r in rows}) == len({r["valid_map"] for r in rows}) == 3


def test_scale_bench_smoke(tmp_path):
    """The scale benchmark end to end on a tiny class model: every kind built through
    index.kinds, recall against its own brute force, a table and a figure."""
    from benchmarks.scale_bench import main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in results} == {"flat", "ivfsq48", "ivfsq48:coarse=4"}
    for r in results:
        assert {row["d"] for row in r["rows"]} == {16, 24}
        assert all(0.5 <= row["recall"] <= 1 for row in r["rows"]), r
    assert next(r for r in results if r["kind"] == "ivfsq48:coarse=4")["params"]["coarse"] == 4
    assert (tmp_path / "table.md").read_text().count("| 2,000 |") == 2 + 2 * 2  # rows of d
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_photo_table_bench_smoke(tmp_path):
    from benchmarks.photo_table_bench import main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {(r["n"], r["loader"]) for r in results} == {(2000, "meta"), (2000, "table")}
    assert all(r["rows"] == 2000 for r in results)


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
