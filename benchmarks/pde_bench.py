"""Benchmark of the operator experiments (python -m training.pde).

1. Seconds per training step of each method at the paper architecture (L = 16 disjoint
   3-layer MLPs, 128 hidden, K = 1024 Fourier features; hydrogen), batch 128 and 512, with
   the default arithmetic (``--stencil-precision auto --fused-update auto``).
2. The cpu preset's measures for NeuralSVD-seq, NeuralSVD-jnt, NeuralEF and SpIN side by
   side at the same budget (same preset, iterations and seed).
3. The grid solver the problem carries (finite differences + scipy eigsh): error and time.

With --preset-steps it only times one step of each problem's cpu preset with the
finite-difference stencil (the default arithmetic) and with the forward-mode Laplacian,
interleaved, 1 thread (CPU seconds beside wall seconds, for a shared machine):

    python -m benchmarks.pde_bench --preset-steps --steps 20

    python -m benchmarks.pde_bench --out runs/pde-bench [--iterations N] [--skip-steps]

Writes OUT/bench.json and OUT/errors_by_method.png and prints markdown tables.

With --paper-step it only times the NeuralSVD-seq step (finite-difference Laplacian, the
update and the EMA included) at the paper architecture on 1 thread, batch 128 and 512, with
the default arithmetic and with the former defaults (fp32 stencil, torch's RMSprop), the
two interleaved in one process. With --paper-code DIR --paper-python PY it also runs the
paper's published code (a checkout of github.com/jongharyu/neural-svd at DIR, run by the
interpreter PY of an environment that has its dependencies: torch, scipy<1.17, torch-ema,
ConfigArgParse, tensorboardX, classy_vision, termplotlib, toml) on the same problem and
architecture, 1 thread, between its own measurements, for --rounds rounds, and prints the
ratios measured side by side:

    python -m benchmarks.pde_bench --paper-step --steps 9 --rounds 3 \\
        --paper-code DIR --paper-python PY

--smoke runs every part on a tiny architecture and batch (seconds), for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from training.allocator import tune_allocator
from training.device import pick_device
from training.pde import plots
from training.pde.arithmetic import choose_fused_update, choose_stencil_precision
from training.pde.config import preset
from training.pde.grid import solve_grid
from training.pde.methods import METHODS
from training.pde.problems import make_problem
from training.pde.run import run
from training.pde.train import Trainer

# what --methods compares by default (any of training.pde.methods.METHODS may be named): the
# paper's two nestings and its two baselines
COMPARED = ("neuralsvd-seq", "neuralsvd-jnt", "neuralef", "spin")
BATCHES = (128, 512)
# the step with the former defaults, and with today's (resolved on the machine it runs on)
VARIANTS = {"fp32, torch's update": dict(stencil_precision="fp32", fused_update="false"),
            "defaults": dict(stencil_precision="auto", fused_update="auto")}
SMOKE = dict(fourier_features=8, hidden=8)  # --smoke: the architecture, batch 16


def _trainer(problem, batch_size: int, method="neuralsvd-seq", smoke=False, **arithmetic):
    """(Trainer, stencil precision) of the paper preset at this batch, its arithmetic
    resolved as training resolves it."""
    config = preset("paper", problem, method=method, batch_size=batch_size,
                    **(SMOKE if smoke else {}), **arithmetic)
    device = pick_device(config.device)
    precision, _ = choose_stencil_precision(config.stencil_precision, device, batch_size,
                                            config.laplacian)
    fused, _ = choose_fused_update(config.fused_update, device)
    return Trainer.build(config, problem, device, fused), precision


def seconds_per_step(problem, method: str, batch_size: int, steps: int, warmup: int = 2,
                     smoke: bool = False) -> tuple[float, float]:
    """(wall, CPU seconds of this process) per training step with the defaults."""
    trainer, precision = _trainer(problem, batch_size, method, smoke)
    for i in range(warmup + steps):
        if i == warmup:
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
        trainer.step(batch_size, precision)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


def paper_step(problem, batch_size: int, steps: int, warmup: int = 2,
               smoke: bool = False) -> dict:
    """Median wall and CPU seconds per NeuralSVD-seq step (fd; the update and the EMA of the
    parameters included, as in training and the paper's code) of each of ``VARIANTS``, one
    model each, in rotating order; and what the defaults resolved to."""
    runs = {}
    for name, arithmetic in VARIANTS.items():
        trainer, precision = _trainer(problem, batch_size, smoke=smoke, **arithmetic)
        runs[name] = dict(trainer=trainer, precision=precision, wall=[], cpu=[])
    names = list(runs)
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = runs[name]
            wall, cpu = time.perf_counter(), time.process_time()
            r["trainer"].step(batch_size, r["precision"])
            if i >= warmup:
                r["wall"].append(time.perf_counter() - wall)
                r["cpu"].append(time.process_time() - cpu)
    return {name: {"wall": statistics.median(r["wall"]), "cpu": statistics.median(r["cpu"]),
                   "precision": r["precision"], "update": r["trainer"].update_kind()}
            for name, r in runs.items()}


# (problem, ndim) of --preset-steps
PRESET_PROBLEMS = [("hydrogen", None), ("oscillator", None), ("hydrogen-3d", None),
                   ("oscillator", 10)]


def preset_steps(steps: int, warmup: int = 2, smoke: bool = False) -> dict:
    """Median wall and CPU seconds per step of each problem's cpu preset with
    ``--laplacian fd`` and ``forward`` (the default arithmetic otherwise), the two
    interleaved."""
    out = {}
    for name, ndim in PRESET_PROBLEMS:
        problem = make_problem(name, ndim)
        runs = {}
        for laplacian in ("fd", "forward"):
            config = preset("cpu", problem, ndim=ndim or 0, laplacian=laplacian,
                            **(dict(SMOKE, batch_size=16) if smoke else {}))
            device = pick_device(config.device)
            precision, _ = choose_stencil_precision(config.stencil_precision, device,
                                                    config.batch_size, laplacian)
            fused, _ = choose_fused_update(config.fused_update, device)
            runs[laplacian] = dict(trainer=Trainer.build(config, problem, device, fused),
                                   precision=precision, b=config.batch_size, wall=[], cpu=[])
        for i in range(warmup + steps):
            for r in runs.values():
                wall, cpu = time.perf_counter(), time.process_time()
                r["trainer"].step(r["b"], r["precision"])
                if i >= warmup:
                    r["wall"].append(time.perf_counter() - wall)
                    r["cpu"].append(time.process_time() - cpu)
        key = name if ndim is None else f"{name} --ndim {ndim}"
        out[key] = {lap: {"wall": statistics.median(r["wall"]),
                          "cpu": statistics.median(r["cpu"]), "precision": r["precision"],
                          "batch": r["b"]} for lap, r in runs.items()}
        fd, fw = out[key]["fd"], out[key]["forward"]
        print(f"| {key} | {fd['batch']} | {1e3 * fd['cpu']:.1f} ({fd['precision']}) | "
              f"{1e3 * fw['cpu']:.1f} | {fd['cpu'] / fw['cpu']:.2f}x | "
              f"{1e3 * fd['wall']:.1f} / {1e3 * fw['wall']:.1f} |", flush=True)
    return out


# The published code's arguments for the paper's hydrogen run (its scripts/exps/pde/
# hydrogen.sh) with L = 16, NeuralSVD-seq, evaluation off; the batch and length are added.
PAPER_ARGS = [
    "--optimizer", "rmsprop", "--use_lr_scheduler", "--ema_decay", "0.995", "--lr", "1e-4",
    "--momentum", "0.", "--laplacian_eps", "0.01", "--eval_freq", "100000000", "--overwrite",
    "--potential_type", "hydrogen", "--ndim", "2", "--lim", "50", "--val_eps", "0.1",
    "--neigs", "16", "--apply_boundary", "0", "--boundary_mode", "dir_box_sqrt",
    "--apply_exp_mask", "0", "--exp_mask_init_scale", "100", "--mlp_hidden_dims",
    "128,128,128", "--hard_mul_const", "1.", "--parallel", "1", "--nonlinearity", "softplus",
    "--sampling_mode", "gaussian", "--sampling_scale", "16", "--operator_scale", "100",
    "--use_fourier_feature", "--fourier_mapping_size", "1024", "--fourier_scale", "0.1",
    "--sort", "0", "--neuralsvd.step", "1", "--neuralsvd.sequential", "1",
    "--residual_weight", "0.", "--loss_name", "neuralsvd", "--seed", "0", "--print_freq", "10",
]


def seconds_from_paper_log(stdout: str) -> float:
    """Seconds per step from the cumulative times the published code prints every 10
    steps: (last - first) / steps between them (its first 10 steps, with start-up, are
    left out)."""
    marks = [(int(i), float(t)) for i, t in
             re.findall(r"'iter': (\d+).*?'time': ([0-9.eE+-]+)", stdout)]
    if len(marks) < 2:
        raise RuntimeError(f"fewer than two timings in the paper code's output: "
                           f"{stdout[-500:]!r}")
    (i0, t0), (i1, t1) = marks[0], marks[-1]
    return (t1 - t0) / (i1 - i0)


def paper_code_step(code_dir: str, python: str, batch_size: int, iterations: int,
                    log_dir: str) -> float:
    """Seconds per step of the published code on 1 thread (``seconds_from_paper_log``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": code_dir, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [python, "examples/operator/pde/main_pde.py", *PAPER_ARGS, "--batch_size",
           str(batch_size), "--num_iters", str(iterations), "--log_dir", log_dir]
    out = subprocess.run(cmd, cwd=code_dir, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the paper's code did not run (exit {out.returncode}): "
                           f"{(out.stderr or out.stdout)[-2000:]}")
    return seconds_from_paper_log(out.stdout)


def _side_by_side_table(rows: list, batches) -> None:
    print("\nSide by side, 1 thread (each round: the paper's code, then this project's "
          "steps; seconds per step; ratio: the paper's code / this step)\n\n"
          "| batch | paper's code | " + " | ".join(f"{v} | ratio" for v in VARIANTS) + " |\n"
          "|---|---|" + "---|---|" * len(VARIANTS))
    for b in batches:
        ref = [r["paper_code"][b] for r in rows]
        cells = [f"{min(ref):.3f}-{max(ref):.3f}"]
        for name in VARIANTS:
            own = [r[name][b] for r in rows]
            ratios = [a / o for a, o in zip(ref, own, strict=True)]
            cells += [f"{min(own):.3f}-{max(own):.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}x"]
        print(f"| {b} | " + " | ".join(cells) + " |")


def _paper_step_table(rows: dict) -> None:
    print("\nNeuralSVD-seq step, fd Laplacian, paper architecture (hydrogen, L = 16, 3x128 "
          "MLPs, K = 1024), 1 thread: median seconds per step, wall (CPU); ratio: the former "
          "defaults' wall time over the defaults'\n\n| batch | "
          + " | ".join(VARIANTS) + " | ratio | the defaults here |\n|---|---|---|---|---|")
    for b, r in rows.items():
        old, new = (r[name] for name in VARIANTS)
        print(f"| {b} | " + " | ".join(f"{r[n]['wall']:.3f} ({r[n]['cpu']:.3f})"
                                       for n in VARIANTS)
              + f" | {old['wall'] / new['wall']:.2f}x | {new['precision']}, {new['update']} |")


def _paper_mode(args, out: Path, batches) -> None:
    """--paper-step, with --paper-code side by side."""
    torch.set_num_threads(1)  # as the paper's code is timed
    problem = make_problem("hydrogen")
    if not args.paper_code:
        rows = {b: paper_step(problem, b, args.steps, smoke=args.smoke) for b in batches}
        (out / "paper_step.json").write_text(json.dumps(
            {"problem": "hydrogen", "threads": 1, "steps": args.steps,
             "seconds_per_step": rows}, indent=1))
        _paper_step_table(rows)
        return
    rounds = []
    for r in range(args.rounds):
        row = {"paper_code": {}, **{name: {} for name in VARIANTS}}
        for b in batches:
            row["paper_code"][b] = paper_code_step(
                args.paper_code, args.paper_python, b, 30 if b == 128 else 20,
                str(out / "paper-code-log"))
            times = paper_step(problem, b, args.steps, smoke=args.smoke)
            for name in VARIANTS:
                row[name][b] = times[name]["wall"]
            row.setdefault("defaults_are", {})[b] = (times["defaults"]["precision"],
                                                     times["defaults"]["update"])
            print(f"round {r + 1}, batch {b}: paper's code {row['paper_code'][b]:.3f} "
                  f"s/step, " + ", ".join(f"{name} {row[name][b]:.3f}" for name in VARIANTS),
                  flush=True)
        rounds.append(row)
    (out / "paper_side_by_side.json").write_text(json.dumps(
        {"problem": "hydrogen", "threads": 1, "rounds": rounds}, indent=1))
    _side_by_side_table(rounds, batches)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--out", default="runs/pde-bench")
    parser.add_argument("--problem", default="hydrogen", choices=["hydrogen", "oscillator"])
    parser.add_argument("--iterations", type=int, default=None,
                        help="override the cpu preset's iterations (same for every method)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--methods", nargs="+", default=list(COMPARED), choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--paper-code", default="",
                        help="with --paper-step: a checkout of the paper's code, timed side by "
                             "side (needs --paper-python)")
    parser.add_argument("--paper-python", default="",
                        help="the interpreter of an environment that runs the paper's code")
    parser.add_argument("--rounds", type=int, default=3,
                        help="side-by-side rounds with --paper-code")
    parser.add_argument("--paper-step", action="store_true",
                        help="only time the NeuralSVD-seq step with the defaults against the "
                             "former ones, interleaved, hydrogen at batch 128 and 512 on 1 "
                             "thread (ignores --problem and --threads)")
    parser.add_argument("--preset-steps", action="store_true",
                        help="only time one step of each problem's cpu preset, fd against "
                             "the forward-mode Laplacian, 1 thread")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny architecture, batch 16, 1 step, 3 iterations, a coarse "
                             "grid: that every part runs, in seconds")
    return parser


def main(argv=None):
    tune_allocator()
    parser = _parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.paper_code and not (args.paper_step and args.paper_python):
        parser.error("--paper-code needs --paper-step and --paper-python")
    batches = (16,) if args.smoke else BATCHES
    if args.smoke:
        args.steps, args.iterations = 1, 3
    if args.paper_step:
        _paper_mode(args, out, batches)
        return
    if args.preset_steps:
        torch.set_num_threads(1)
        print("| problem | batch | fd: CPU ms per step | forward: CPU ms | ratio | wall ms, "
              "fd / forward |\n|---|---|---|---|---|---|")
        rows = preset_steps(args.steps, smoke=args.smoke)
        (out / "preset_steps.json").write_text(json.dumps(rows, indent=1))
        return
    torch.set_num_threads(args.threads)
    problem = make_problem(args.problem)
    result: dict = {"problem": args.problem, "threads": args.threads,
                    "device": str(pick_device())}
    if not args.skip_steps:
        rows = {}
        for method in args.methods:
            for b in batches:
                wall, cpu = seconds_per_step(problem, method, b, args.steps, smoke=args.smoke)
                rows[f"{method} @ {b}"] = {"wall": wall, "cpu": cpu}
                print(f"{method:14s} batch {b:4d}: {wall:.3f} s/step wall, {cpu:.3f} cpu",
                      flush=True)
        result["seconds_per_step_paper_arch"] = rows
    if not args.skip_train:
        result["cpu_preset"] = _train_methods(args, problem, out)
    if not args.skip_grid:
        g = solve_grid(problem, n=40 if args.smoke else None)
        keys = ("seconds", "grid_points", "spacing", "rel_error_mean", "angle_distance_mean",
                "subspace_distance_mean", "orthogonality", "rel_errors")
        result["grid"] = {k: g[k] for k in keys}
        print(f"grid: {json.dumps({k: g[k] for k in keys[:7]})}", flush=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    _print_tables(result, batches)


def _train_methods(args, problem, out: Path) -> dict:
    """The cpu preset run by each method (the same iterations and seed)."""
    overrides = {} if args.iterations is None else {"iterations": args.iterations}
    if args.smoke:
        overrides.update(SMOKE, batch_size=16, ritz_samples=256, eval_points=2048)
    runs = {}
    for method in args.methods:
        config = preset("cpu", problem, method=method, threads=args.threads,
                        out=str(out / method), **overrides)
        m = run(config, progress=False)
        runs[method] = {k: m[k] for k in (
            "iterations", "seconds", "rel_error_mean", "angle_distance_mean",
            "subspace_distance_mean", "orthogonality", "rel_errors", "eigenvalues",
            "eigenvalues_norm")}
        print(f"{method}: {json.dumps({k: runs[method][k] for k in list(runs[method])[:6]})}",
              flush=True)
    plots.errors_per_mode({k: v["rel_errors"] for k, v in runs.items()},
                          out / "errors_by_method.png",
                          f"{args.problem}, cpu preset: eigenvalue errors per mode")
    return {"config": dataclasses.asdict(config), "runs": runs}


def _print_tables(result, batches):
    if "seconds_per_step_paper_arch" in result:
        print("\n| method | " + " | ".join(f"batch {b}: wall / CPU s per step" for b in batches)
              + " |\n|---|" + "---|" * len(batches))
        rows = result["seconds_per_step_paper_arch"]
        for m in dict.fromkeys(k.split(" @ ")[0] for k in rows):
            print(f"| {m} | " + " | ".join(
                f"{rows[f'{m} @ {b}']['wall']:.3f} / {rows[f'{m} @ {b}']['cpu']:.3f}"
                for b in batches) + " |")
    table = dict(result.get("cpu_preset", {}).get("runs", {}))
    if "grid" in result:
        table["grid+eigsh"] = {**result["grid"], "iterations": "-"}
    if table:
        print("\n| method | iterations | seconds | rel. error (mean) | angle dist. | "
              "subspace dist. | orthogonality |\n|---|---|---|---|---|---|---|")
        for m, r in table.items():
            print(f"| {m} | {r['iterations']} | {r['seconds']:.0f} | {r['rel_error_mean']:.3g} | "
                  f"{r['angle_distance_mean']:.3g} | {r['subspace_distance_mean']:.3g} | "
                  f"{r['orthogonality']:.3g} |")


if __name__ == "__main__":
    main()
