"""Benchmark of the CDK retrieval job on sketchy-mini, split 2, offline backbone.

Compares (a) raw backbone features with cosine similarity (all dimensions, and cut to their
top-d principal axes for the curves), (b) unstructured LoRA, (c) NeuralSVD-seq and
(d) NeuralSVD-jnt: same cached features, same preset (budget: epochs, batch, head), same
seeds; NeuralSVD-seq runs at the preset's lr for it (the cpu preset lowers it to 0.005).
Reports mAP@all and P@10 (mean and std over seeds), mAP with the d most significant modes,
the fraction of full-dimension mAP that (d) keeps at d = 16, 32, 64, 128, and the wall time
of the preset per run (every run trains from scratch; features come from the on-disk cache
once the first run has filled it).

    python -m benchmarks.cdk_bench --data ../shared/data/sketchy-mini --out runs/cdk-bench
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from training.cdk.checkpoint import atomic_write_text
from training.cdk.config import NESTING_WEIGHTS, PRESETS, make_config
from training.cdk.evaluate import plot_structure
from training.cdk.run import run

METHODS = ("lora", "neuralsvd-seq", "neuralsvd-jnt")
FRACTION_DIMS = (16, 32, 64, 128)


def _ms(values) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.4f}" if len(v) == 1 else f"{v.mean():.4f} ± {v.std(ddof=1):.4f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/cdk-bench")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--split", default="sketchy2")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--nesting-weights", default="uniform", choices=NESTING_WEIGHTS,
                   help="joint-nesting weights of neuralsvd-jnt")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(a.out)

    res: dict[str, list[dict]] = {m: [] for m in METHODS}
    for seed in a.seeds:
        for method in METHODS:
            run_dir = out / f"{method}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # time a fresh run, never a resume
            extra = {"nesting_weights": a.nesting_weights} if method == "neuralsvd-jnt" else {}
            cfg = make_config(a.preset, data=a.data, split=a.split, method=method,
                              seed=seed, out=str(run_dir), threads=a.threads, **extra)
            t0 = time.perf_counter()
            m = run(cfg)
            m["wall_seconds"] = time.perf_counter() - t0
            res[method].append(m)
    jnt = res["neuralsvd-jnt"]
    raw = jnt[0]["raw_backbone_cosine"]  # deterministic: same features for every run
    k, dims = raw["k"], sorted(int(d) for d in jnt[0]["map_by_dims"])

    def by_d(method, key="map_by_dims"):
        return {d: float(np.mean([r[key][str(d)] for r in res[method]])) for d in dims}

    full = {m: float(np.mean([r["map_all"] for r in res[m]])) for m in METHODS}
    lrs = ", ".join(f"{m} {res[m][0]['config']['lr']}" for m in METHODS)
    rows = [f"split {a.split}, seeds {a.seeds}, preset {a.preset}, lr {lrs}, neuralsvd-jnt "
            f"weights {a.nesting_weights}", "",
            f"| method | mAP@all | P@{k} |", "|---|---|---|",
            f"| (a) raw {jnt[0]['backbone']} features, cosine | {raw['map_all']:.4f} | "
            f"{raw['precision_at_k']:.4f} |"]
    for tag, m in zip("bcd", METHODS, strict=True):
        rows.append(f"| ({tag}) {m} | {_ms([r['map_all'] for r in res[m]])} | "
                    f"{_ms([r['precision_at_k'] for r in res[m]])} |")
    rows += ["", "| mAP@all, d most significant modes | " + " | ".join(map(str, dims)) + " |",
             "|---" * (len(dims) + 1) + "|"]
    pca = {d: float(jnt[0]["raw_backbone_pca_map_by_dims"][str(d)]) for d in dims}
    rows.append("| (a) raw features, top-d principal axes, cosine | " +
                " | ".join(f"{v:.3f}" for v in pca.values()) + " |")
    for m in METHODS:
        rows.append(f"| {m} | " + " | ".join(f"{v:.3f}" for v in by_d(m).values()) + " |")
    rows.append("| neuralsvd-jnt, d least significant | " + " | ".join(
        f"{v:.3f}" for v in by_d("neuralsvd-jnt", "map_by_dims_least").values()) + " |")
    frac = {d: by_d("neuralsvd-jnt")[d] / full["neuralsvd-jnt"] for d in FRACTION_DIMS
            if d in dims}
    rows += ["", "| (d) fraction of full-dimension mAP kept at d | " +
             " | ".join(map(str, frac)) + " |", "|---" * (len(frac) + 1) + "|",
             "| neuralsvd-jnt | " + " | ".join(f"{v:.3f}" for v in frac.values()) + " |"]
    mj, ml = by_d("neuralsvd-jnt"), by_d("lora")
    beats = {d: {"raw_full_dim": mj[d] > raw["map_all"], "raw_pca_same_d": mj[d] > pca[d],
                 "lora_same_d": mj[d] > ml[d]} for d in dims if d <= 128}
    rows += ["", f"neuralsvd-jnt with d modes beats (a) raw cosine on all "
             f"{jnt[0]['backbone']} dimensions: " + ", ".join(
                 f"d={d}: {'yes' if b['raw_full_dim'] else 'no'}" for d, b in beats.items()),
             "neuralsvd-jnt with d modes beats (a) raw features on their top-d principal axes: "
             + ", ".join(f"d={d}: {'yes' if b['raw_pca_same_d'] else 'no'}"
                         for d, b in beats.items()),
             "neuralsvd-jnt with d modes beats (b) lora with d modes: " + ", ".join(
                 f"d={d}: {'yes' if b['lora_same_d'] else 'no'}" for d, b in beats.items())]
    timing = {m: {"wall_seconds": [r["wall_seconds"] for r in res[m]],
                  "train_seconds": [r["train_seconds"] for r in res[m]]} for m in METHODS}
    rows += ["", "wall time per run of the preset, s (training part in brackets): " + "; ".join(
        f"{m} " + ", ".join(f"{w:.0f} ({t:.0f})" for w, t in
                            zip(v["wall_seconds"], v["train_seconds"], strict=True))
        for m, v in timing.items())]
    table = "\n".join(rows)
    print(table)
    curves = {m: {d: {"map_all": v} for d, v in by_d(m).items()} for m in METHODS}
    curves["neuralsvd-jnt (d least significant)"] = {
        d: {"map_all": v} for d, v in by_d("neuralsvd-jnt", "map_by_dims_least").items()}
    curves["raw cosine (all dims)"] = {d: {"map_all": raw["map_all"]} for d in dims}
    curves["raw cosine (top-d principal axes)"] = {d: {"map_all": v} for d, v in pca.items()}
    plot_structure(curves, out / "structure.png")
    atomic_write_text(table + "\n", out / "table.md")
    atomic_write_text(json.dumps({
        "seeds": a.seeds, "nesting_weights": a.nesting_weights,
        "raw_backbone_cosine": raw, "raw_backbone_pca_map_by_dims": pca,
        "fraction_of_full_map": frac,
        "beats": beats, "timing": timing,
        "results": {m: [{k2: v for k2, v in r.items() if k2 != "history"} for r in rs]
                    for m, rs in res.items()}}, indent=2), out / "bench.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
