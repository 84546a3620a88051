"""python -m training.pde PROBLEM [--method M] [--preset paper|cpu] [--iterations N]
[--batch-size B] [--seed S] [--out DIR] [--ndim D] (and any other Config field)."""

from __future__ import annotations

import sys

from training import cli
from training.allocator import tune_allocator
from training.pde.config import parse_args
from training.pde.run import run


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    tune_allocator()
    config = parse_args(argv)
    m = run(config)
    print(
        f"{m['problem']} {m['method']}: {m['iterations']} steps in {m['seconds']:.0f}s; "
        f"rel_error_mean {m['rel_error_mean']:.3g}, "
        f"subspace_distance_mean {m['subspace_distance_mean']:.3g}, "
        f"orthogonality {m['orthogonality']:.3g}{_surplus(m)}; wrote {config.out}/metrics.json"
    )
    if m["ritz"] is not None:
        r = m["ritz"]
        print(f"after Rayleigh-Ritz ({r['samples']} samples): rel_error_mean "
              f"{r['rel_error_mean']:.3g}, subspace_distance_mean "
              f"{r['subspace_distance_mean']:.3g}, order_correct {r['order_correct']}"
              f"{_surplus(r)}")
    return 0


def _surplus(m: dict) -> str:
    """The largest norm among the modes beyond the evaluated ones (the oscillator's surplus
    modes, which should have norm ~0), when there are any."""
    n = len(m["eigenvalues_true"])
    rest = [abs(v) for v in m["eigenvalues_norm"][n:]]
    return f", largest surplus norm {max(rest):.2g}" if rest else ""


if __name__ == "__main__":
    sys.exit(main())
