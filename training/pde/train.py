"""Training loop: RMSprop with a cosine learning-rate schedule, an exponential moving
average of the parameters for evaluation, atomic checkpoints and resume, and a progress
bar with the current eigenvalue estimates."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from training.device import pick_device
from training.pde.checkpoint import (
    CHECKPOINT,
    build_model,
    check_resumable,
    load_train_state,
    save_checkpoint,
)
from training.pde.config import Config, batch_size_at, problem_of
from training.pde.laplacian import negative_hamiltonian
from training.pde.methods import make_method
from training.pde.networks import DisjointMLPs
from training.pde.update import FusedUpdate

__all__ = ["train", "make_schedule"]

log = logging.getLogger(__name__)


def _format(eigs: torch.Tensor) -> str:
    return " ".join(f"{v:.3g}" for v in eigs.tolist())


def make_schedule(optimizer: torch.optim.Optimizer, iterations: int, lr_floor: float):
    """Cosine annealing of the optimizer's lr (its one parameter group's) over
    ``iterations`` steps, from lr to lr * lr_floor:
    lr (floor + (1 - floor) (1 + cos(pi t / T)) / 2) at step t."""
    base = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=iterations, eta_min=base * lr_floor)


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
    schedule = make_schedule(optimizer, T, config.lr_floor)
    fused = None
    if config.fused_update and device.type != "cpu":
        log.warning("--fused-update is for the CPU; %s uses torch's RMSprop and EMA", device)
    elif config.fused_update:
        fused = FusedUpdate(optimizer, ema.parameters(), config.ema_decay)
    gen = torch.Generator().manual_seed(config.seed + 1)
    step, seconds, running = 0, 0.0, torch.zeros(L, dtype=torch.float64)

    if config.resume and ckpt_path.exists():
        ckpt = load_train_state(ckpt_path, map_location=device)
        check_resumable(ckpt["config"], config)
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        schedule.load_state_dict(ckpt["schedule"])
        method.load_state_dict(ckpt["method"])
        # the sampler's generator lives on the CPU; map_location moved its state along
        gen.set_state(ckpt["generator"].cpu())
        step, seconds = ckpt["step"], ckpt["seconds"]
        running = torch.as_tensor(ckpt["eigenvalues_estimate"], dtype=torch.float64)
        log.info("resumed %s at step %d", ckpt_path, step)

    def checkpoint():
        save_checkpoint(ckpt_path, config=config, step=step, seconds=seconds, model=model,
                        ema=ema, optimizer=optimizer, schedule=schedule, method=method,
                        generator=gen, eigenvalues_estimate=running.tolist())

    bar = tqdm(total=T, initial=step, disable=not progress, dynamic_ncols=True, leave=False)
    start = time.perf_counter() - seconds
    while step < T:
        x = problem.sample(batch_size_at(config, step), gen, device, torch.float32)
        ft, Tft = negative_hamiltonian(model, problem, x, config.laplacian, config.fd_eps,
                                       config.stencil_precision)
        loss, eigs = method(ft, Tft, params)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if fused is not None:
            fused.step()  # the update and the EMA in one pass
        else:
            optimizer.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), params, strict=True):
                    pe.lerp_(p, 1 - config.ema_decay)
        schedule.step()
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
