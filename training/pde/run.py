"""The pipeline of ``python -m training.pde``: train, evaluate, and write OUT/metrics.json
and the figures."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from training.files import atomic_write_text
from training.pde import plots
from training.pde.config import Config, problem_of
from training.pde.evaluate import aligned_functions, evaluate
from training.pde.ritz import nested_modes, ritz_rotation
from training.pde.train import train

__all__ = ["run"]

log = logging.getLogger(__name__)


def run(config: Config, progress: bool = True) -> dict:
    """Train, evaluate the EMA model and write OUT/metrics.json plus PNGs; returns the
    metrics."""
    problem = problem_of(config)
    model, info = train(config, progress=progress)
    ritz = values = None
    if config.ritz_samples:
        # its own stream of samples, apart from training's
        values, C = ritz_rotation(model, problem, config.ritz_samples, config.seed + 7919,
                                  config.laplacian, config.fd_eps)
        ritz = nested_modes(values, C)
    result = evaluate(model, problem, config.laplacian, config.fd_eps, config.eval_points,
                      ritz)
    m = result["metrics"]
    out = Path(config.out)
    metrics = {
        "problem": problem.name,
        "ndim": problem.ndim,
        "preset": config.preset,
        "method": config.method,
        "iterations": info["steps"],
        "seconds": info["seconds"],
        "device": info["device"],
        # what --stencil-precision and --fused-update chose, and why; the time estimated
        # before the first step
        "arithmetic": info["arithmetic"],
        "estimate": info["estimate"],
        **m,
        # the same measures after the Rayleigh-Ritz step (--ritz-samples), with the Ritz
        # values it estimated from its samples; null without one
        "ritz": None if ritz is None else {"samples": config.ritz_samples,
                                           "ritz_values": values.tolist(), **result["ritz"]},
        "config": dataclasses.asdict(config),
    }
    atomic_write_text(json.dumps(metrics, indent=1), out / "metrics.json")
    _figures(config, problem, model, result, ritz, out)
    return metrics


def _figures(config, problem, model, result, ritz, out: Path) -> None:
    """orthogonality.png, errors.png (where the spectrum is known) and the problem's own
    figures of the functions (after the Ritz step when there is one)."""
    label = f"{problem.name} {config.method}"
    plots.plot_gram(result["gram"], out / "orthogonality.png", f"{label}: orthogonality")
    m = result["metrics"]
    if m["rel_errors"] is not None:
        errors = {config.method: m["rel_errors"]}
        if ritz is not None:
            errors[f"{config.method}, after Rayleigh-Ritz"] = result["ritz"]["rel_errors"]
        plots.errors_per_mode(errors, out / "errors.png", f"{label}: eigenvalue errors")
    kind = "trained" if ritz is None else "ritz"
    rotations, norms = result["alignment"][kind]
    if problem.figures is not None and rotations is not None:
        aligned = aligned_functions(model, problem, rotations, norms, ritz)
        problem.figures(aligned, problem, out,
                        label if ritz is None else f"{label}, after Rayleigh-Ritz")
