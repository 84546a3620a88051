"""Benchmark of the CDK retrieval job on sketchy-mini, split 2, offline backbone.

Compares (a) raw backbone features with cosine similarity, (b) unstructured LoRA,
(c) NeuralSVD-seq and (d) NeuralSVD-jnt: same cached features, same preset (budget),
same seed. Reports mAP@all and P@10, mAP with the d most significant modes, the fraction
of full-dimension mAP that (d) keeps at d = 16, 32, 64, 128, and the wall time of the
preset (features cached or not, as stated).

    python -m benchmarks.cdk_bench --data ../shared/data/sketchy-mini --out runs/cdk-bench
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from training.cdk.checkpoint import atomic_write_text
from training.cdk.config import PRESETS, make_config
from training.cdk.evaluate import plot_structure
from training.cdk.run import run

METHODS = ("lora", "neuralsvd-seq", "neuralsvd-jnt")
FRACTION_DIMS = (16, 32, 64, 128)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/cdk-bench")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    results, curves = {}, {}
    for method in METHODS:
        cfg = make_config(a.preset, data=a.data, split="sketchy2", method=method, seed=a.seed,
                          out=str(Path(a.out) / method), threads=a.threads)
        t0 = time.perf_counter()
        m = run(cfg)
        m["wall_seconds"] = time.perf_counter() - t0
        results[method] = m
        curves[method] = {int(d): {"map_all": v} for d, v in m["map_by_dims"].items()}
    jnt = results["neuralsvd-jnt"]
    curves["neuralsvd-jnt (d least significant)"] = {
        int(d): {"map_all": v} for d, v in jnt["map_by_dims_least"].items()}
    raw = jnt["raw_backbone_cosine"]
    k = jnt["k"]

    rows = [f"| method | mAP@all | P@{k} |", "|---|---|---|",
            f"| (a) raw {jnt['backbone']} features, cosine | {raw['map_all']:.4f} | "
            f"{raw['precision_at_k']:.4f} |"]
    for tag, method in zip("bcd", METHODS, strict=True):
        r = results[method]
        rows.append(f"| ({tag}) {method} | {r['map_all']:.4f} | {r['precision_at_k']:.4f} |")
    dims = sorted({int(d) for d in jnt["map_by_dims"]})
    rows += ["", "| mAP@all with the d most significant modes | " +
             " | ".join(str(d) for d in dims) + " |", "|---" * (len(dims) + 1) + "|"]
    for method in METHODS:
        rows.append(f"| {method} | " + " | ".join(
            f"{results[method]['map_by_dims'][str(d)]:.3f}" for d in dims) + " |")
    rows.append("| neuralsvd-jnt, d least significant | " + " | ".join(
        f"{jnt['map_by_dims_least'][str(d)]:.3f}" for d in dims) + " |")
    frac = {d: jnt["map_by_dims"][str(d)] / jnt["map_all"] for d in FRACTION_DIMS
            if str(d) in jnt["map_by_dims"]}
    rows += ["", "| (d) fraction of full-dimension mAP kept at d | " +
             " | ".join(str(d) for d in frac) + " |", "|---" * (len(frac) + 1) + "|",
             "| neuralsvd-jnt | " + " | ".join(f"{v:.3f}" for v in frac.values()) + " |"]
    beats = {d: jnt["map_by_dims"][str(d)] > max(raw["map_all"],
                                                 results["lora"]["map_by_dims"][str(d)])
             for d in dims if d <= 128}
    rows += ["", f"neuralsvd-jnt beats raw cosine (full {jnt['backbone']} dimension) and lora "
             f"at the same d: " + ", ".join(f"d={d}: {'yes' if b else 'no'}"
                                            for d, b in beats.items())]
    timing = {m: {"wall_seconds": results[m]["wall_seconds"],
                  "train_seconds": results[m]["train_seconds"]} for m in METHODS}
    rows += ["", "wall time of the preset per method (s; features cached after the first "
             "method): " + ", ".join(f"{m} {t['wall_seconds']:.0f} (training "
                                     f"{t['train_seconds']:.0f})" for m, t in timing.items())]
    table = "\n".join(rows)
    print(table)
    out = Path(a.out)
    plot_structure(curves, out / "structure.png")
    atomic_write_text(table + "\n", out / "table.md")
    atomic_write_text(json.dumps({"raw_backbone_cosine": raw, "fraction_of_full_map": frac,
                                  "beats_raw_and_lora": beats, "timing": timing,
                                  "results": {m: {k2: v for k2, v in r.items() if k2 != "history"}
                                              for m, r in results.items()}}, indent=2),
                      out / "bench.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
