"""Benchmark of the operator experiments (python -m training.pde).

1. Seconds per training step of each method at the paper architecture (L = 16 disjoint
   3-layer MLPs, 128 hidden, K = 1024 Fourier features; hydrogen), batch 128 and 512.
2. The cpu preset's measures for NeuralSVD-seq, NeuralSVD-jnt, NeuralEF and SpIN side by
   side at the same budget (same preset, iterations and seed).
3. The grid solver (5-point finite differences + scipy eigsh): error and time.

    python -m benchmarks.pde_bench --out runs/pde-bench [--iterations N] [--skip-steps]

Writes OUT/bench.json and OUT/errors_by_method.png and prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from training.device import pick_device
from training.pde import plots
from training.pde.checkpoint import build_model
from training.pde.config import preset
from training.pde.grid import solve_grid
from training.pde.laplacian import negative_hamiltonian
from training.pde.methods import make_method
from training.pde.problems import make_problem
from training.pde.run import run

METHODS = ["neuralsvd-seq", "neuralsvd-jnt", "neuralef", "spin"]


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


def main(argv=None):
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
