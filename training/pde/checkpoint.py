"""PDE checkpoints: one file, OUT/checkpoint.pt, holding the config it was trained with,
the weights, their moving average (EMA, used for evaluation) and the state to resume from.

Layout (a dict of tensors and plain values, saved with torch.save, read with
``weights_only=True``)::

    format: FORMAT (a file of another format is refused with a message saying so)
    config: Config as a dict (the model is rebuilt from it; loaders need no flags)
    step: int; seconds: float (training time so far)
    model, ema: state_dicts of DisjointMLPs
    optimizer, schedule, method: state_dicts (the method's moving averages for SpIN)
    generator: RNG state of the sampler; eigenvalues_estimate: the smoothed display values
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from training.files import atomic_save
from training.pde.config import Config, problem_of
from training.pde.networks import DisjointMLPs
from training.pde.schrodinger import Problem

__all__ = ["CHECKPOINT", "build_model", "save_checkpoint", "load_checkpoint",
           "load_train_state", "check_resumable"]

CHECKPOINT = "checkpoint.pt"
FORMAT = 2  # 2: problems as Schrodinger operators (kinetic, shift None), "auto" arithmetic
# settings that may differ between a run and its resumption (fused_update: the same update
# to float rounding, for resuming where no compiler is at hand)
RESUMABLE = frozenset({"resume", "threads", "device", "out", "checkpoint_every", "eval_points",
                       "ritz_samples", "fused_update"})
# config fields renamed since files of this format were first written: old name -> new
RENAMED = {"n_modes": "modes"}


def build_model(config: Config, problem: Problem) -> DisjointMLPs:
    """The network a config describes, initialised from ``config.seed``."""
    gen = torch.Generator().manual_seed(config.seed)
    return DisjointMLPs(
        modes=config.modes or problem.modes,
        ndim=problem.ndim,
        fourier_features=config.fourier_features,
        fourier_scale=config.fourier_scale,
        hidden=config.hidden,
        generator=gen,
    )


def save_checkpoint(path: str | Path, *, config: Config, step: int, seconds: float,
                    model: torch.nn.Module, ema: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, schedule, method,
                    generator: torch.Generator, eigenvalues_estimate: list[float]) -> Path:
    """Write the training state atomically (layout in the module docstring)."""
    return atomic_save(
        {
            "format": FORMAT,
            "config": dataclasses.asdict(config),
            "step": int(step),
            "seconds": float(seconds),
            "model": model.state_dict(),
            "ema": ema.state_dict(),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "method": method.state_dict(),
            "generator": generator.get_state(),
            "eigenvalues_estimate": list(eigenvalues_estimate),
        },
        path,
    )


def load_train_state(path: str | Path, map_location="cpu") -> dict:
    """The raw checkpoint dict (its config under today's field names: RENAMED);
    FileNotFoundError or ValueError naming a file that is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{str(path)!r} is not a training.pde checkpoint: {e}") from e
    if not isinstance(ckpt, dict) or not {"config", "ema", "step"} <= ckpt.keys():
        raise ValueError(f"{str(path)!r} is not a training.pde checkpoint (no config/ema/step)")
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is a training.pde checkpoint of format "
                         f"{ckpt.get('format', 1)}, this version reads format {FORMAT}: "
                         f"train it again")
    ckpt["config"] = {RENAMED.get(k, k): v for k, v in ckpt["config"].items()}
    return ckpt


def load_checkpoint(path: str | Path, map_location="cpu") -> tuple[Config, DisjointMLPs, dict]:
    """(config, EMA model, the raw checkpoint): the model is rebuilt from the stored config."""
    ckpt = load_train_state(path, map_location)
    config = Config(**ckpt["config"])
    model = build_model(config, problem_of(config))
    model.load_state_dict(ckpt["ema"])
    return config, model, ckpt


def check_resumable(saved: dict, config: Config) -> None:
    """ValueError listing the settings of ``config`` that differ from the stored ``saved``
    (a config dict), other than those a resumed run may change (``RESUMABLE``)."""
    now = dataclasses.asdict(config)
    diff = sorted(k for k in now if k not in RESUMABLE and saved.get(k) != now[k])
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in diff)
        raise ValueError(f"cannot resume: settings differ from the checkpoint ({detail})")
