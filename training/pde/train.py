"""Training loop: RMSprop with a cosine learning-rate schedule, an exponential moving
average of the parameters for evaluation, atomic checkpoints and resume, a progress bar
with the current eigenvalue estimates, and before the first step an estimate of the run's
time from a few trial steps."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from training.device import pick_device
from training.pde.arithmetic import choose_fused_update, choose_stencil_precision
from training.pde.checkpoint import (
    CHECKPOINT,
    build_model,
    check_resumable,
    load_train_state,
    save_checkpoint,
)
from training.pde.config import Config, batch_size_at, problem_of
from training.pde.evaluate import learned_functions
from training.pde.laplacian import negative_hamiltonian
from training.pde.methods import make_method
from training.pde.networks import DisjointMLPs
from training.pde.schrodinger import Problem
from training.pde.update import FusedUpdate

__all__ = ["train", "make_schedule", "Trainer", "estimate_seconds"]

log = logging.getLogger(__name__)
TRIAL_STEPS = 3  # steps of a throwaway copy timed for the estimate (the first is warm-up)


def _format(eigs: torch.Tensor) -> str:
    return " ".join(f"{v:.3g}" for v in eigs.tolist())


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def make_schedule(optimizer: torch.optim.Optimizer, iterations: int, lr_floor: float):
    """Cosine annealing of the optimizer's lr (its one parameter group's) over
    ``iterations`` steps, from lr to lr * lr_floor:
    lr (floor + (1 - floor) (1 + cos(pi t / T)) / 2) at step t."""
    base = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=iterations, eta_min=base * lr_floor)


@dataclass
class Trainer:
    """The state of one run (model, EMA, optimiser, schedule, method, sampler) and its step."""

    config: Config
    problem: Problem
    device: torch.device
    model: DisjointMLPs
    ema: DisjointMLPs
    optimizer: torch.optim.RMSprop
    schedule: torch.optim.lr_scheduler.LRScheduler
    method: object
    fused: FusedUpdate | None
    gen: torch.Generator

    @classmethod
    def build(cls, config: Config, problem: Problem, device: torch.device,
              fused: bool) -> Trainer:
        """Everything initialised from ``config.seed``; ``fused``: the compiled update
        (``training.pde.update``), which falls back to torch's where it does not compile."""
        torch.manual_seed(config.seed)
        model = build_model(config, problem).to(device)
        ema = copy.deepcopy(model).requires_grad_(False)
        optimizer = torch.optim.RMSprop(list(model.parameters()), lr=config.lr)
        update = None
        if fused:
            update = FusedUpdate(optimizer, ema.parameters(), config.ema_decay,
                                 warn=config.fused_update == "true")
            if update.compile_error and config.fused_update == "auto":
                update = None  # torch's update, in several passes
        return cls(config, problem, device, model, ema, optimizer,
                   make_schedule(optimizer, config.iterations, config.lr_floor),
                   make_method(config.method, model.modes, config), update,
                   torch.Generator().manual_seed(config.seed + 1))

    def update_kind(self) -> str:
        if self.fused is None:
            return "torch's RMSprop and EMA"
        if self.fused.compile_error:
            return f"fused, uncompiled (torch.compile failed: {self.fused.compile_error})"
        return "fused, compiled"

    def step(self, batch_size: int, precision: str, index: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training step ``index`` on a fresh batch: (loss, eigenvalue estimates (L,))."""
        c = self.config
        x = self.problem.sample(batch_size, self.gen, self.device, torch.float32)
        ft, Tft = negative_hamiltonian(self.model, self.problem, x, c.laplacian, c.fd_eps,
                                       precision)
        params = self.optimizer.param_groups[0]["params"]
        loss, eigs = self.method(ft, Tft, params)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {index}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.fused is not None:
            self.fused.step()  # the update and the EMA in one pass
        else:
            self.optimizer.step()
            with torch.no_grad():
                for pe, p in zip(self.ema.parameters(), params, strict=True):
                    pe.lerp_(p, 1 - c.ema_decay)
        self.schedule.step()
        return loss, eigs

    def state_dict(self) -> dict:
        return dict(model=self.model, ema=self.ema, optimizer=self.optimizer,
                    schedule=self.schedule, method=self.method, generator=self.gen)

    def load(self, ckpt: dict) -> None:
        for key in ("model", "ema", "optimizer", "schedule", "method"):
            getattr(self, key).load_state_dict(ckpt[key])
        # the sampler's generator lives on the CPU; map_location moved its state along
        self.gen.set_state(ckpt["generator"].cpu())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def estimate_seconds(config: Config, problem: Problem, device: torch.device, fused: bool,
                     precisions: dict[int, str], first_step: int = 0) -> dict:
    """The run's time: each batch size's step timed on a throwaway copy of the run
    (``TRIAL_STEPS`` steps, the first left out as warm-up) times the steps left at that
    size, plus the evaluation: the float64 operator timed on 512 points, scaled to the
    quadrature's points and the Rayleigh-Ritz samples. The run itself is not touched."""
    per_step = {}
    with torch.random.fork_rng(devices=[]):  # (Trainer.build seeds torch's generator)
        trial = Trainer.build(config, problem, device, fused)
        for b, precision in precisions.items():
            for i in range(TRIAL_STEPS):
                if i == 1:
                    _sync(device)
                    start = time.perf_counter()
                trial.step(b, precision)
            _sync(device)
            per_step[b] = (time.perf_counter() - start) / (TRIAL_STEPS - 1)
    steps = [batch_size_at(config, s) for s in range(first_step, config.iterations)]
    train_s = sum(per_step[b] * steps.count(b) for b in per_step)
    x, _ = problem.evaluation_rule("cpu", config.eval_points or None)
    start = time.perf_counter()
    learned_functions(trial.ema, problem, x[:512], config.laplacian, config.fd_eps)
    points = len(x) + config.ritz_samples
    eval_s = (time.perf_counter() - start) * points / min(512, len(x))
    return {"step_seconds": {str(b): t for b, t in per_step.items()},
            "train_seconds": train_s, "eval_seconds": eval_s, "eval_points": points}


def _arithmetic(config: Config, device: torch.device) -> tuple[dict[int, str], bool, dict]:
    """The stencil precision per batch size and the fused update, chosen and logged."""
    sizes = sorted({config.batch_size, config.final_batch_size or config.batch_size})
    precisions, why = {}, {}
    for b in sizes:
        precisions[b], reason = choose_stencil_precision(config.stencil_precision, device, b,
                                                         config.laplacian)
        why[str(b)] = {"precision": precisions[b], "why": reason}
        log.info("stencil precision %s at batch %d (%s)", precisions[b], b, reason)
    fused, reason = choose_fused_update(config.fused_update, device)
    return precisions, fused, {"stencil_precision": why, "fused_update_why": reason}


def train(config: Config, progress: bool = True) -> tuple[DisjointMLPs, dict]:
    """Train per config; returns (EMA model on CPU, info: steps, seconds, device, the
    arithmetic chosen, the time estimated before the first step). Writes
    OUT/checkpoint.pt every checkpoint_every steps and at the end."""
    torch.set_num_threads(config.threads)
    problem = problem_of(config)
    device = pick_device(config.device)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT
    precisions, fused, arithmetic = _arithmetic(config, device)
    run = Trainer.build(config, problem, device, fused)
    arithmetic["update"] = run.update_kind()
    log.info("parameter update: %s (%s)", arithmetic["update"], arithmetic["fused_update_why"])
    step, seconds = 0, 0.0
    running = torch.zeros(run.model.modes, dtype=torch.float64)
    if config.resume and ckpt_path.exists():
        ckpt = load_train_state(ckpt_path, map_location=device)
        check_resumable(ckpt["config"], config)
        run.load(ckpt)
        step, seconds = ckpt["step"], ckpt["seconds"]
        running = torch.as_tensor(ckpt["eigenvalues_estimate"], dtype=torch.float64)
        log.info("resumed %s at step %d", ckpt_path, step)
    guess = estimate_seconds(config, problem, device, fused, precisions, step)
    log.info("estimated time: %s of training (%d steps at %s ms per step, timed on %d trial "
             "steps) + %s of evaluation (%d points at the rate of 512 timed)",
             _duration(guess["train_seconds"]), config.iterations - step,
             "/".join(f"{1e3 * t:.1f}" for t in guess["step_seconds"].values()),
             TRIAL_STEPS - 1, _duration(guess["eval_seconds"]), guess["eval_points"])

    def checkpoint():
        save_checkpoint(ckpt_path, config=config, step=step, seconds=seconds,
                        eigenvalues_estimate=running.tolist(), **run.state_dict())

    T = config.iterations
    bar = tqdm(total=T, initial=step, disable=not progress, dynamic_ncols=True, leave=False)
    start = time.perf_counter() - seconds
    while step < T:
        b = batch_size_at(config, step)
        loss, eigs = run.step(b, precisions[b], step)
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
    info = {"steps": step, "seconds": seconds, "device": str(device), "arithmetic": arithmetic,
            "estimate": guess}
    log.info("trained %s/%s for %d steps in %.1fs", problem.name, config.method, step, seconds)
    return run.ema.cpu(), info
