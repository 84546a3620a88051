"""Benchmark of the operator experiments (python -m training.pde).

1. Seconds per training step of each method at the paper architecture (L = 16 disjoint
   3-layer MLPs, 128 hidden, K = 1024 Fourier features; hydrogen), batch 128 and 512.
2. The cpu preset's measures for NeuralSVD-seq, NeuralSVD-jnt, NeuralEF and SpIN side by
   side at the same budget (same preset, iterations and seed).
3. The grid solver (5-point finite differences + scipy eigsh): error and time.

    python -m benchmarks.pde_bench --out runs/pde-bench [--iterations N] [--skip-steps]

Writes OUT/bench.json and OUT/errors_by_method.png and prints markdown tables.

With --paper-step it only times the NeuralSVD-seq step (finite-difference Laplacian) at
the paper architecture on 1 thread, batch 128 and 512, in fp32, with the bf16 stencil
(--stencil-precision bf16) and with it and the fused update (--fused-update true), against
the step it replaced (every stencil point differentiated, T f carrying its graph), all
interleaved in one process, next to the paper's published code timed on the same 2-core
machine:

    python -m benchmarks.pde_bench --paper-step --steps 9

With --paper-code DIR --paper-python PY it also runs the paper's published code (a checkout
of github.com/jongharyu/neural-svd at DIR, run by the interpreter PY of an environment
that has its dependencies: torch, scipy<1.17, torch-ema, ConfigArgParse, pandas, ...) on
the same problem and architecture, 1 thread, between its own measurements, for --rounds
rounds, and prints the ratios measured side by side:

    python -m benchmarks.pde_bench --paper-step --steps 9 --rounds 3 \
        --paper-code /tmp/nsvd --paper-python /tmp/refvenv/bin/python
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
from training.pde.checkpoint import build_model
from training.pde.config import preset
from training.pde.grid import solve_grid
from training.pde.laplacian import negative_hamiltonian
from training.pde.methods import make_method
from training.pde.problems import make_problem
from training.pde.run import run
from training.pde.update import FusedUpdate

METHODS = ["neuralsvd-seq", "neuralsvd-jnt", "neuralef", "spin"]
# The paper's published code, same problem and architecture (NeuralSVD-seq, fd), seconds
# per step on 1 thread of this project's 2-core machine: (lowest, highest) over runs; the
# target is twice as fast as its best.
PAPER_CODE = {128: (0.14, 0.23), 512: (0.49, 0.74)}
TARGET = {128: 0.07, 512: 0.25}


def seconds_per_step(problem, method: str, batch_size: int, steps: int, warmup: int = 2):
    config = preset("paper", problem, method=method, batch_size=batch_size)
    device = pick_device()
    model = build_model(config, problem).to(device)
    params = list(model.parameters())
    meth = make_method(method, model.n_modes, config)
    opt = torch.optim.RMSprop(params, lr=config.lr)
    gen = torch.Generator().manual_seed(0)
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
        x = problem.sample(batch_size, gen, device, torch.float32)
        ft, Tft = negative_hamiltonian(model, problem, x, config.laplacian, config.fd_eps)
        loss, _ = meth(ft, Tft, params)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    # wall seconds, and CPU seconds of this process (less sensitive to a shared machine)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


def _full_graph_hamiltonian(model, problem, x, eps):
    """The step's operator before T f became a constant: all 2D+1 stencil points in one
    graph-tracked call, so the backward pass runs over 5B rows in 2D."""
    B, D = x.shape
    shifts = torch.zeros(2 * D + 1, D, dtype=x.dtype, device=x.device)
    idx = torch.arange(D, device=x.device)
    shifts[1 + idx, idx] = eps
    shifts[1 + D + idx, idx] = -eps
    pts = (x.unsqueeze(0) + shifts.unsqueeze(1)).reshape(-1, D)  # centre first
    out = model(pts).reshape(2 * D + 1, B, -1)  # (2D+1, B, L)
    logw = problem.log_weight(pts).reshape(2 * D + 1, B)
    ratio = torch.exp(0.5 * (logw[1:] - logw[:1])).unsqueeze(-1)
    lap = ((ratio * out[1:]).sum(0) - 2 * D * out[0]) / eps**2
    return out[0], lap + (problem.shift - problem.potential(x)).unsqueeze(-1) * out[0]


STEPS = ("full graph", "this step", "this step, bf16", "this step, bf16, fused update")
FUSED = {"this step, bf16, fused update"}  # these run training.pde.update.FusedUpdate


def paper_step(problem, batch_size: int, steps: int, warmup: int = 2,
               only: tuple[str, ...] = STEPS) -> dict:
    """Median wall and CPU seconds per NeuralSVD-seq step (fd; the update and the EMA of
    the parameters included, as in training and the paper's code) of the full-graph step, of
    the current one, of it with the bf16 stencil (``--stencil-precision bf16``) and of that
    with the fused update (``--fused-update true``), on one model each, in rotating order
    (``only``: those of ``STEPS``)."""
    config = preset("paper", problem, method="neuralsvd-seq", batch_size=batch_size)
    hamiltonians = {
        "full graph": lambda m, x: _full_graph_hamiltonian(m, problem, x, config.fd_eps),
        "this step": lambda m, x: negative_hamiltonian(m, problem, x, "fd", config.fd_eps),
        "this step, bf16": lambda m, x: negative_hamiltonian(m, problem, x, "fd",
                                                             config.fd_eps, "bf16"),
    }
    hamiltonians["this step, bf16, fused update"] = hamiltonians["this step, bf16"]
    hamiltonians = {k: hamiltonians[k] for k in only}
    runs = {}
    for name, hamiltonian in hamiltonians.items():
        model = build_model(config, problem)
        params = list(model.parameters())
        runs[name] = dict(
            hamiltonian=hamiltonian, model=model, params=params,
            method=make_method(config.method, model.n_modes, config),
            opt=torch.optim.RMSprop(params, lr=config.lr),
            ema=[p.detach().clone() for p in params],
            gen=torch.Generator().manual_seed(0), wall=[], cpu=[],
        )
        if name in FUSED:  # compiled here, before the timed steps
            runs[name]["fused"] = FusedUpdate(runs[name]["opt"], runs[name]["ema"],
                                              config.ema_decay)
    names = list(runs)
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = runs[name]
            wall, cpu = time.perf_counter(), time.process_time()
            x = problem.sample(batch_size, r["gen"], "cpu", torch.float32)
            ft, Tft = r["hamiltonian"](r["model"], x)
            loss, _ = r["method"](ft, Tft, r["params"])
            r["opt"].zero_grad(set_to_none=True)
            loss.backward()
            if "fused" in r:
                r["fused"].step()
            else:
                r["opt"].step()
                with torch.no_grad():  # the parameters' EMA, kept by training and the paper's code
                    torch._foreach_lerp_(r["ema"], r["params"], 1 - config.ema_decay)
            if i >= warmup:
                r["wall"].append(time.perf_counter() - wall)
                r["cpu"].append(time.process_time() - cpu)
    return {name: {"wall": statistics.median(r["wall"]), "cpu": statistics.median(r["cpu"])}
            for name, r in runs.items()}


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


def paper_code_step(code_dir: str, python: str, batch_size: int, iterations: int,
                    log_dir: str) -> float:
    """Seconds per step of the published code on 1 thread: from the cumulative times it
    prints every 10 steps, (last - first) / steps between them (the first 10 steps, with
    start-up, are left out)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": code_dir, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [python, "examples/operator/pde/main_pde.py", *PAPER_ARGS, "--batch_size",
           str(batch_size), "--num_iters", str(iterations), "--log_dir", log_dir]
    out = subprocess.run(cmd, cwd=code_dir, env=env, capture_output=True, text=True)
    marks = [(int(i), float(t)) for i, t in
             re.findall(r"'iter': (\d+).*?'time': ([0-9.eE+-]+)", out.stdout)]
    if out.returncode != 0 or len(marks) < 2:
        raise RuntimeError(f"the paper's code did not run (exit {out.returncode}): "
                           f"{(out.stderr or out.stdout)[-2000:]}")
    (i0, t0), (i1, t1) = marks[0], marks[-1]
    return (t1 - t0) / (i1 - i0)


def _side_by_side_table(rows: list) -> None:
    print("\nSide by side, 1 thread (each round: the paper's code, then this project's "
          "steps; seconds per step; ratio: the paper's code / this step)\n\n"
          "| batch | paper's code | this step (fp32) | ratio | bf16 stencil | ratio | "
          "bf16 stencil, fused update | ratio |\n|---|---|---|---|---|---|---|---|")
    for b in (128, 512):
        ref = [r["paper_code"][b] for r in rows]
        cells = [f"{min(ref):.3f}-{max(ref):.3f}"]
        for name in STEPS[1:]:
            own = [r[name][b] for r in rows]
            ratios = [a / o for a, o in zip(ref, own, strict=True)]
            cells += [f"{min(own):.3f}-{max(own):.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}x"]
        print(f"| {b} | " + " | ".join(cells) + " |")


def _paper_step_table(rows: dict) -> None:
    print("\nNeuralSVD-seq step, fd Laplacian, paper architecture (hydrogen, L = 16, 3x128 "
          "MLPs, K = 1024), 1 thread: median seconds per step, wall (CPU); ratio: the full "
          "graph's wall time over this one's; the paper's code was timed separately on the "
          "same machine\n\n| batch | full graph (before) | this step | ratio | "
          "bf16 stencil | ratio | bf16 stencil, fused update | ratio | paper's code | "
          "target |\n|---|---|---|---|---|---|---|---|---|---|")
    for b, r in rows.items():
        old = r["full graph"]
        lo, hi = PAPER_CODE[b]
        cells = [f"{old['wall']:.3f} ({old['cpu']:.3f})"]
        for name in STEPS[1:]:
            new = r[name]
            cells += [f"{new['wall']:.3f} ({new['cpu']:.3f})", f"{old['wall'] / new['wall']:.2f}x"]
        print(f"| {b} | " + " | ".join(cells) + f" | {lo:.2f}-{hi:.2f} | <= {TARGET[b]:.2f} |")


def main(argv=None):
    tune_allocator()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--out", default="runs/pde-bench")
    parser.add_argument("--problem", default="hydrogen", choices=["hydrogen", "oscillator"])
    parser.add_argument("--iterations", type=int, default=None,
                        help="override the cpu preset's iterations (same for every method)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
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
                        help="only time the NeuralSVD-seq step against the full-graph one, "
                             "interleaved, hydrogen at batch 128 and 512 on 1 thread (ignores "
                             "--problem and --threads)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.paper_code and not (args.paper_step and args.paper_python):
        parser.error("--paper-code needs --paper-step and --paper-python")
    if args.paper_code:
        torch.set_num_threads(1)
        rounds, own = [], STEPS[1:]
        for r in range(args.rounds):
            row = {"paper_code": {}, **{name: {} for name in own}}
            for b in (128, 512):
                row["paper_code"][b] = paper_code_step(
                    args.paper_code, args.paper_python, b, 30 if b == 128 else 20,
                    str(out / "paper-code-log"))
                times = paper_step(make_problem("hydrogen"), b, args.steps, only=own)
                for name in own:
                    row[name][b] = times[name]["wall"]
                print(f"round {r + 1}, batch {b}: paper's code {row['paper_code'][b]:.3f} "
                      f"s/step, " + ", ".join(f"{name} {row[name][b]:.3f}" for name in own),
                      flush=True)
            rounds.append(row)
        (out / "paper_side_by_side.json").write_text(json.dumps(
            {"problem": "hydrogen", "threads": 1, "rounds": rounds}, indent=1))
        _side_by_side_table(rounds)
        return
    if args.paper_step:
        torch.set_num_threads(1)  # as the paper's code was timed
        rows = {}
        for b in (128, 512):
            rows[b] = paper_step(make_problem("hydrogen"), b, args.steps)
            print(f"batch {b}: " + ", ".join(
                f"{k} {v['wall']:.3f} s/step wall, {v['cpu']:.3f} cpu" for k, v in rows[b].items()
            ), flush=True)
        (out / "paper_step.json").write_text(json.dumps(
            {"problem": "hydrogen", "threads": 1, "steps": args.steps,
             "paper_code": PAPER_CODE, "target": TARGET, "seconds_per_step": rows}, indent=1))
        _paper_step_table(rows)
        return
    torch.set_num_threads(args.threads)
    problem = make_problem(args.problem)
    result: dict = {"problem": args.problem, "threads": args.threads,
                    "device": str(pick_device())}

    if not args.skip_steps:
        rows = {}
        for method in args.methods:
            for b in (128, 512):
                wall, cpu = seconds_per_step(problem, method, b, args.steps)
                rows[f"{method} @ {b}"] = {"wall": wall, "cpu": cpu}
                print(f"{method:14s} batch {b:4d}: {wall:.3f} s/step wall, {cpu:.3f} cpu",
                      flush=True)
        result["seconds_per_step_paper_arch"] = rows

    if not args.skip_train:
        overrides = {} if args.iterations is None else {"iterations": args.iterations}
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
        result["cpu_preset"] = {"config": dataclasses.asdict(config), "runs": runs}
        plots.errors_per_mode({k: v["rel_errors"] for k, v in runs.items()},
                              out / "errors_by_method.png",
                              f"{args.problem}, cpu preset: eigenvalue errors per mode")

    if not args.skip_grid:
        g = solve_grid(problem)
        keys = ("seconds", "grid_points", "spacing", "rel_error_mean", "angle_distance_mean",
                "subspace_distance_mean", "orthogonality", "rel_errors")
        result["grid"] = {k: g[k] for k in keys}
        print(f"grid: {json.dumps({k: g[k] for k in keys[:7]})}", flush=True)

    (out / "bench.json").write_text(json.dumps(result, indent=1))
    _print_tables(result)


def _print_tables(result):
    if "seconds_per_step_paper_arch" in result:
        print("\n| method | batch 128: wall / CPU s per step | batch 512: wall / CPU s per step |"
              "\n|---|---|---|")
        rows = result["seconds_per_step_paper_arch"]
        for m in [k.split(" @ ")[0] for k in rows if k.endswith("@ 128")]:
            a, b = rows[f"{m} @ 128"], rows[f"{m} @ 512"]
            print(f"| {m} | {a['wall']:.3f} / {a['cpu']:.3f} | {b['wall']:.3f} / {b['cpu']:.3f} |")
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
