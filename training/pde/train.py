"""Training loop: RMSprop with a cosine learning-rate schedule, an exponential moving
average of the parameters for evaluation, atomic checkpoints and resume, and a progress
bar with the current eigenvalue estimates."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from training.atomic import atomic_save
from training.device import pick_device
from training.pde.config import Config, problem_of
from training.pde.laplacian import negative_hamiltonian
from training.pde.methods import make_method
from training.pde.networks import DisjointMLPs
from training.pde.problems import Problem

__all__ = ["build_model", "train", "load_checkpoint", "CHECKPOINT"]

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"
# settings that may differ between a run and its resumption
_RESUMABLE = {"resume", "threads", "device", "out", "checkpoint_every", "eval_points"}


def build_model(config: Config, problem: Problem) -> DisjointMLPs:
    gen = torch.Generator().manual_seed(config.seed)
    return DisjointMLPs(
        n_modes=config.n_modes or problem.n_modes,
        ndim=problem.ndim,
        fourier_features=config.fourier_features,
        fourier_scale=config.fourier_scale,
        hidden=config.hidden,
        generator=gen,
    )


def _read(path, map_location) -> dict:
    """The checkpoint dict; only tensors and plain values are unpickled (weights_only), so a
    crafted file cannot run code. ValueError names a file that is not a checkpoint."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{str(path)!r} is not a training.pde checkpoint: {e}") from e


def load_checkpoint(path, map_location="cpu") -> tuple[Config, DisjointMLPs, dict]:
    """(config, EMA model, the raw checkpoint): the model is rebuilt from the stored config."""
    ckpt = _read(path, map_location)
    config = Config(**ckpt["config"])
    model = build_model(config, problem_of(config))
    model.load_state_dict(ckpt["ema"])
    return config, model, ckpt


def _check_resumable(saved: dict, config: Config) -> None:
    now = dataclasses.asdict(config)
    diff = sorted(k for k in now if k not in _RESUMABLE and saved.get(k) != now[k])
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in diff)
        raise ValueError(f"cannot resume: settings differ from the checkpoint ({detail})")


def _format(eigs: torch.Tensor) -> str:
    return " ".join(f"{v:.3g}" for v in eigs.tolist())


def train(config: Config, progress: bool = True) -> tuple[DisjointMLPs, dict]:
    """Train per config; returns (EMA model on CPU, info with steps, seconds, device).
    Writes OUT/checkpoint.pt every checkpoint_every steps and at the end."""
    torch.set_num_threads(config.threads)
    problem = problem_of(config)
    device = pick_device(config.device)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT

    torch.manual_seed(config.seed)
    model = build_model(config, problem).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    L = model.n_modes
    method = make_method(config.method, L, config)
    params = list(model.parameters())
    optimizer = torch.optim.RMSprop(params, lr=config.lr)
    T = config.iterations
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, T) / T))
    )
    gen = torch.Generator().manual_seed(config.seed + 1)
    step, seconds, running = 0, 0.0, torch.zeros(L, dtype=torch.float64)

    if config.resume and ckpt_path.exists():
        ckpt = _read(ckpt_path, device)
        _check_resumable(ckpt["config"], config)
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        schedule.load_state_dict(ckpt["schedule"])
        method.load_state_dict(ckpt["method"])
        gen.set_state(ckpt["generator"])
        step, seconds = ckpt["step"], ckpt["seconds"]
        running = torch.as_tensor(ckpt["eigenvalues_estimate"], dtype=torch.float64)
        log.info("resumed %s at step %d", ckpt_path, step)

    def checkpoint():
        atomic_save(
            {
                "config": dataclasses.asdict(config),
                "step": step,
                "seconds": seconds,
                "model": model.state_dict(),
                "ema": ema.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "method": method.state_dict(),
                "generator": gen.get_state(),
                "eigenvalues_estimate": running.tolist(),
            },
            ckpt_path,
        )

    bar = tqdm(total=T, initial=step, disable=not progress, dynamic_ncols=True, leave=False)
    start = time.perf_counter() - seconds
    while step < T:
        x = problem.sample(config.batch_size, gen, device, torch.float32)
        ft, Tft = negative_hamiltonian(model, problem, x, config.laplacian, config.fd_eps)
        loss, eigs = method(ft, Tft, params)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), params, strict=True):
                pe.lerp_(p, 1 - config.ema_decay)
        step += 1
        e = eigs.detach().double().cpu()  # (L,), smoothed for display
        running = e if step == 1 else 0.95 * running + 0.05 * e
        if step % 20 == 0 or step == T:
            bar.set_postfix_str(f"loss {loss.item():.4g} | eig {_format(running)}", refresh=False)
        bar.update(1)
        seconds = time.perf_counter() - start
        if step % config.checkpoint_every == 0 or step == T:
            checkpoint()
    bar.close()
    info = {"steps": step, "seconds": seconds, "device": str(device)}
    log.info("trained %s/%s for %d steps in %.1fs", config.problem, config.method, step, seconds)
    return ema.cpu(), info
