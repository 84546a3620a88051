"""python -m training.pde PROBLEM [--preset auto|paper|cpu] [--method M] [--iterations N]
[--batch-size B] [--seed S] [--out DIR] [--ndim D] (and any other Config field);
python -m training.pde schrodinger --potential package.module:function --ndim D ..."""

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
    print(f"{m['problem']} {m['method']} ({m['preset'] or 'no'} preset): {m['iterations']} "
          f"steps in {m['seconds']:.0f}s; {_measures(m)}; wrote {config.out}/metrics.json")
    if m["ritz"] is not None:
        r = m["ritz"]
        print(f"after Rayleigh-Ritz ({r['samples']} samples): {_measures(r)}")
    return 0


def _measures(m: dict) -> str:
    """The summary measures that the problem's known spectrum allows, and the largest norm
    among the modes beyond the evaluated ones (the oscillator's surplus modes, which should
    have norm ~0), when there are any."""
    keys = ["rel_error_mean", "subspace_distance_mean", "orthogonality", "order_correct"]
    parts = [f"{k} {m[k]:.3g}" if isinstance(m[k], float) else f"{k} {m[k]}"
             for k in keys if m[k] is not None]
    if not m["eigenvalues_true"]:
        parts.insert(0, "eigenvalues " + " ".join(f"{v:.4g}" for v in m["eigenvalues"]))
    n = len(m["eigenvalues_true"])
    rest = [abs(v) for v in m["eigenvalues_norm"][n:]] if n else []
    if rest:
        parts.append(f"largest surplus norm {max(rest):.2g}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
