"""The measurements of the product (benchmarks/): every script imports and parses its
command line (they are run by hand, so a renamed import would otherwise only show up when
someone runs them), and every one runs in its smoke mode, on a tiny generated data set where
it needs one. The experiments are research/'s (tests/test_research.py)."""

import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import benchmarks
from tests.tiny_data import tiny_paired

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
OWN_TEST = {"cdk_bench", "loss_bench", "pde_bench", "scale_bench", "scale_ceilings",
            "photo_table_bench"}


def test_every_benchmark_has_a_smoke_mode_that_is_run():
    assert set(SMOKE) == set(NAMES), f"no --smoke: {sorted(set(NAMES) - set(SMOKE))}"
    own = {n for n in OWN_TEST if any(t.startswith(f"test_{n}_smoke") for t in globals())}
    assert own == OWN_TEST <= set(SMOKE)


@pytest.mark.parametrize("name", [n for n in SMOKE if n not in OWN_TEST])
def test_benchmark_runs_in_its_smoke_mode(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--smoke"]) == 0
    assert capsys.readouterr().out  # it reports


def test_the_service_benchmarks_have_a_smoke_mode():
    assert {"service_bench", "encoder_bench", "memory_bench"} <= set(SMOKE)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return tiny_paired(tmp_path_factory.mktemp("tiny"))


def test_loss_bench_smoke(capsys):
    from benchmarks import loss_bench

    loss_bench.main(["--smoke", "--device", "cpu"])
    assert capsys.readouterr().out.count("speed-up") == 2  # CDK and EVD


def test_one_name_per_registry():
    """The benchmarks compare methods of the training registries under names of their own
    (COMPARED), and the cdk benchmark's rows are every method of the config."""
    from benchmarks import cdk_bench, pde_bench
    from training.cdk.config import METHODS as CDK_METHODS
    from training.pde.methods import METHODS as PDE_METHODS

    assert set(cdk_bench.COMPARED) == set(CDK_METHODS)
    assert set(pde_bench.COMPARED) <= set(PDE_METHODS)
    assert not hasattr(cdk_bench, "METHODS")
    assert pde_bench.METHODS is PDE_METHODS


def test_cdk_bench_smoke(tiny_data, tmp_path, capsys):
    from benchmarks import cdk_bench

    root, split = tiny_data
    assert cdk_bench.main(["--smoke", "--data", str(root), "--split", str(split), "--out",
                           str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text()
    for row in ("(b) lora", "(c) neuralsvd-seq", "(d) neuralsvd-jnt"):
        assert row in table


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
        # served: a search of 100 and their vectors re-scored; its top 10 as a second full
        # search's on these class-clustered vectors
        assert all(row["p50_served_ms"] > row["p50_ms"] > 0 for row in r["rows"]), r
        assert all(0.9 <= row["served_same"] <= 1 for row in r["rows"]), r
    assert next(r for r in results if r["kind"] == "ivfsq48:coarse=4")["params"]["coarse"] == 4
    assert (tmp_path / "table.md").read_text().count("| 2,000 |") == 2 + 2 * 2  # rows of d
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_scale_ceilings_smoke(tmp_path):
    """Each stage's ceiling on a tiny gallery: with every cell probed every neighbour's cell
    is found, even cells have imbalance >= 1, more candidates never find fewer."""
    from benchmarks.scale_ceilings import main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "ceilings-2000.json").read_text())
    assert result["nlist"] == 16 and len(result["cells"]) == 4
    for row in result["cells"]:
        assert row["imbalance"] >= 1
        for entry in row["by_nprobe"]:  # nprobe >= 16 cells: all probed
            assert entry["d16"] == entry["d64"] == 1.0 and entry["scanned_d16"] == 2000
    codes = {(r["codes"], r["d"]): r["recall"] for r in result["codes"]}
    assert codes[("float16", 16)] >= codes[("8-bit", 16)] > 0.5
    for r in result["candidates"]:
        assert 0 < r["R300"] <= r["R1000"] <= r["R3000"] == 1.0  # 3,000 > the 2,000 photos


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
        f"{m} @ 16" for m in pde_bench.COMPARED}
    assert set(result["cpu_preset"]["runs"]) == set(pde_bench.COMPARED)
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
