"""The pipeline of ``python -m training.pde``: train, evaluate, and write OUT/metrics.json
and the plots."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from training.files import atomic_write_text
from training.pde import plots
from training.pde.config import Config, problem_of
from training.pde.evaluate import aligned_on_grid, evaluate
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
        "method": config.method,
        "iterations": info["steps"],
        "seconds": info["seconds"],
        "device": info["device"],
        **m,
        # the same measures after the Rayleigh-Ritz step (--ritz-samples), with the Ritz
        # values it estimated from its samples; null without one
        "ritz": None if ritz is None else {"samples": config.ritz_samples,
                                           "ritz_values": values.tolist(), **result["ritz"]},
        "config": dataclasses.asdict(config),
    }
    atomic_write_text(json.dumps(metrics, indent=1), out / "metrics.json")
    label = f"{problem.name} {config.method}"
    plots.plot_gram(result["gram"], out / "orthogonality.png", f"{label}: orthogonality")
    errors = {config.method: m["rel_errors"]}
    if ritz is not None:
        errors[f"{config.method}, after Rayleigh-Ritz"] = result["ritz"]["rel_errors"]
    plots.errors_per_mode(errors, out / "errors.png", f"{label}: eigenvalue errors")
    if problem.ndim == 2:
        learned, truth = aligned_on_grid(
            model, problem, result["rotations"], result["norms"], problem.plot_half_width
        )
        plots.eigenfunctions(learned, truth, problem.plot_half_width,
                             out / "eigenfunctions.png", f"{label} (aligned) vs analytic")
    return metrics
