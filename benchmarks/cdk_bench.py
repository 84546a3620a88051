"""Benchmark of the CDK retrieval job on sketchy-mini, split 2, offline backbone.

Compares (a) raw backbone features with cosine similarity (all dimensions, and cut to their
top-d principal axes for the curves), (b) unstructured LoRA, (c) NeuralSVD-seq and
(d) NeuralSVD-jnt: same cached features, same preset (budget: epochs, batch, head), same
seeds; NeuralSVD-seq runs at the preset's lr for it (the cpu preset lowers it to 0.005).
Reports mAP@all and P@10 (mean and std over seeds), mAP with the d most significant modes,
the fraction of full-dimension mAP that (d) keeps at d = 16, 32, 64, 128, and the wall time
of the preset per run (every run trains from scratch; features come from the on-disk cache
once the first run has filled it). DIR is the sketch/photo folder:

    python -m benchmarks.cdk_bench --data DIR --out runs/cdk-bench
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from training.allocator import tune_allocator
from training.cdk.config import PRESETS, make_config
from training.cdk.plots import plot_structure
from training.cdk.run import run
from training.files import atomic_write_text

# the methods of training.cdk.config.METHODS in the order of the table's rows (b), (c), (d)
COMPARED = ("lora", "neuralsvd-seq", "neuralsvd-jnt")
FRACTION_DIMS = (16, 32, 64, 128)
# --smoke: the overrides that make a run take seconds on small data
SMOKE = {"modes": 4, "hidden": 16, "epochs": 2, "batch_size": 6, "image_size": 32, "k": 2,
         "gallery_queries": 2, "gallery_topk": 2, "int8": False}


def _ms(values) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.4f}" if len(v) == 1 else f"{v.mean():.4f} ± {v.std(ddof=1):.4f}"


def _variants(preset: str) -> dict[str, dict]:
    """Row name -> config overrides: the three methods at the preset's settings, plus
    neuralsvd-jnt with the paper's uniform weights when the preset uses other weights."""
    out = {m: {"method": m} for m in COMPARED}
    if make_config(preset, method="neuralsvd-jnt").nesting_weights != "uniform":
        out["neuralsvd-jnt, uniform weights"] = {"method": "neuralsvd-jnt",
                                                 "nesting_weights": "uniform"}
    return out


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    tune_allocator()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/cdk-bench")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--split", default="sketchy2")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="small heads, images and run: checks the benchmark, measures nothing")
    a = p.parse_args(argv)
    smoke = SMOKE if a.smoke else {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(a.out)

    variants = _variants(a.preset)
    res: dict[str, list[dict]] = {v: [] for v in variants}
    for seed in a.seeds:
        for name, over in variants.items():
            run_dir = out / f"{name.replace(', ', '-').replace(' ', '-')}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # time a fresh run, never a resume
            cfg = make_config(a.preset, data=a.data, split=a.split, seed=seed,
                              out=str(run_dir), threads=a.threads, **over, **smoke)
            t0 = time.perf_counter()
            m = run(cfg)
            m["wall_seconds"] = time.perf_counter() - t0
            res[name].append(m)
    rows, curves, summary = _report(res, variants, a.split, a.seeds, a.preset)
    table = "\n".join(rows)
    print(table)
    plot_structure(curves, out / "structure.png")
    atomic_write_text(table + "\n", out / "table.md")
    atomic_write_text(json.dumps({
        "seeds": a.seeds, **summary,
        "results": {v: [{k2: x for k2, x in r.items() if k2 != "history"} for r in rs]
                    for v, rs in res.items()}}, indent=2), out / "bench.json")
    return 0


def _report(res: dict, variants: dict, split: str, seeds: list, preset: str):
    """(table rows, structure curves, bench.json's summary) of the runs ``res``."""
    jnt = res["neuralsvd-jnt"]
    raw = jnt[0]["raw_backbone_cosine"]  # deterministic: same features for every run
    k, dims = raw["k"], sorted(int(d) for d in jnt[0]["map_by_dims"])

    def by_d(name, key="map_by_dims"):
        return {d: float(np.mean([r[key][str(d)] for r in res[name]])) for d in dims}

    def settings(name):
        c = res[name][0]["config"]
        return f"lr {c['lr']}" + (f", {c['nesting_weights']} weights"
                                  if c["method"] == "neuralsvd-jnt" else "")

    full = {v: float(np.mean([r["map_all"] for r in res[v]])) for v in variants}
    rows = [f"split {split}, seeds {seeds}, preset {preset}", "",
            f"| method | settings | mAP@all | P@{k} |", "|---|---|---|---|",
            f"| (a) raw {jnt[0]['backbone']} features, cosine | all dimensions | "
            f"{raw['map_all']:.4f} | {raw['precision_at_k']:.4f} |"]
    for tag, v in zip("bcdd", variants, strict=False):
        rows.append(_row([f"({tag}) {v}", settings(v), _ms([r["map_all"] for r in res[v]]),
                          _ms([r["precision_at_k"] for r in res[v]])]))
    pca = {d: float(jnt[0]["raw_backbone_pca_map_by_dims"][str(d)]) for d in dims}
    pca_inner = {d: float(jnt[0]["raw_backbone_pca_inner_map_by_dims"][str(d)]) for d in dims}
    rows += ["", _row(["mAP@all, d most significant modes", *map(str, dims)]),
             "|---" * (len(dims) + 1) + "|",
             _row(["(a) raw features, top-d principal axes, cosine",
                   *(f"{v:.3f}" for v in pca.values())]),
             _row(["(a) raw features, top-d principal axes, inner product",
                   *(f"{v:.3f}" for v in pca_inner.values())])]
    for v in variants:
        rows.append(_row([v, *(f"{x:.3f}" for x in by_d(v).values())]))
    rows.append(_row(["neuralsvd-jnt, d least significant",
                      *(f"{x:.3f}" for x in by_d("neuralsvd-jnt", "map_by_dims_least").values())]))
    frac = {d: by_d("neuralsvd-jnt")[d] / full["neuralsvd-jnt"] for d in FRACTION_DIMS
            if d in dims}
    rows += ["", _row(["(d) fraction of full-dimension mAP kept at d", *map(str, frac)]),
             "|---" * (len(frac) + 1) + "|",
             _row(["neuralsvd-jnt", *(f"{x:.3f}" for x in frac.values())])]
    mj, ml = by_d("neuralsvd-jnt"), by_d("lora")
    beats = {d: {"raw_full_dim": mj[d] > raw["map_all"], "raw_pca_same_d": mj[d] > pca[d],
                 "raw_pca_inner_same_d": mj[d] > pca_inner[d], "lora_same_d": mj[d] > ml[d]}
             for d in dims if d <= 128}
    said = {"raw_full_dim": f"(a) raw cosine on all {jnt[0]['backbone']} dimensions",
            "raw_pca_same_d": "(a) raw features on their top-d principal axes (cosine)",
            "raw_pca_inner_same_d": "(a) the same, scored by inner product",
            "lora_same_d": "(b) lora with d modes"}
    rows.append("")
    for key, text in said.items():
        rows.append(f"neuralsvd-jnt with d modes beats {text}: " + ", ".join(
            f"d={d}: {'yes' if b[key] else 'no'}" for d, b in beats.items()))
    spectra = {v: np.mean([r["singular_values"][:8] for r in res[v]], axis=0) for v in variants
               if res[v][0]["config"]["method"] == "neuralsvd-jnt"}
    rows += ["", "leading singular values (mean over seeds): " + "; ".join(
        f"{v}: " + " ".join(f"{x:.3f}" for x in sv) for v, sv in spectra.items())]
    timing = {v: {"wall_seconds": [r["wall_seconds"] for r in res[v]],
                  "train_seconds": [r["train_seconds"] for r in res[v]]} for v in variants}
    rows += ["", "wall time per run of the preset, s (training part in brackets): " + "; ".join(
        f"{v} " + ", ".join(f"{w:.0f} ({t:.0f})" for w, t in
                            zip(x["wall_seconds"], x["train_seconds"], strict=True))
        for v, x in timing.items())]
    curves = {v: {d: {"map_all": x} for d, x in by_d(v).items()} for v in variants}
    curves["neuralsvd-jnt (d least significant)"] = {
        d: {"map_all": x} for d, x in by_d("neuralsvd-jnt", "map_by_dims_least").items()}
    curves["raw cosine (all dims)"] = {d: {"map_all": raw["map_all"]} for d in dims}
    curves["raw cosine (top-d principal axes)"] = {d: {"map_all": x} for d, x in pca.items()}
    curves["raw inner product (top-d principal axes)"] = {d: {"map_all": x}
                                                          for d, x in pca_inner.items()}
    summary = {"raw_backbone_cosine": raw, "raw_backbone_pca_map_by_dims": pca,
               "raw_backbone_pca_inner_map_by_dims": pca_inner,
               "fraction_of_full_map": frac, "beats": beats, "timing": timing}
    return rows, curves, summary


if __name__ == "__main__":
    raise SystemExit(main())
