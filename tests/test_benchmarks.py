"""Every benchmark script imports and parses its command line (they are run by hand, so a
renamed import would otherwise only show up when someone runs them)."""

import importlib
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


@pytest.mark.parametrize("name", SMOKE)
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
