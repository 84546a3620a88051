"""python -m training.pde PROBLEM [--method M] [--preset paper|cpu] [--iterations N]
[--batch-size B] [--seed S] [--out DIR] [--ndim D] (and any other Config field)."""

from __future__ import annotations

import logging

from training.pde.run import run

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run()
