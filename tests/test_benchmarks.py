"""Every benchmark script imports and parses its command line (they are run by hand, so a
renamed import would otherwise only show up when someone runs them)."""

import importlib
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
