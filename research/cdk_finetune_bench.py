"""Frozen against fine-tuned backbones for CDK retrieval, chosen on validation classes.

Each call trains one or more named variants (a preset plus overrides, optionally more
overrides from ``--set key=value``) with ``training.cdk.run`` and appends one line per run to
OUT/results.jsonl; the table printed at the end (and written to OUT/table.md) covers every
run recorded there, so a sweep can be built up call by call. Columns: validation and test
mAP@all and P@10, the share of full-dimension test mAP kept at d = 16, how far the top-32
singular values are from sorted (largest rise between neighbours), and wall / training time.
Settings are to be compared on the validation columns; the test columns are the report.
``--smoke`` trains SMOKE's tiny heads on small images: a check that the benchmark runs. DIR
is the sketch/photo folder (or set SKETCHY_DATA to it):

    python -m research.cdk_finetune_bench --data DIR \\
        --variants frozen-lite0 finetune-lite0 --seeds 0
    python -m research.cdk_finetune_bench --out runs/ft-bench --report   # table only
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from research.common import add_data_argument, data_folder
from training import cli
from training.allocator import tune_allocator
from training.cdk.config import Config, make_config
from training.cdk.run import run
from training.files import atomic_write_text

# name -> overrides of the cpu preset
VARIANTS: dict[str, dict] = {
    "frozen-lite0": {"backbone": "efficientnet-lite0", "image_size": 0},
    "frozen-lite1": {"backbone": "efficientnet-lite1", "image_size": 0},
    "frozen-lite2": {"backbone": "efficientnet-lite2", "image_size": 0},
    "finetune-lite0": {"backbone": "efficientnet-lite0", "image_size": 0, "finetune": True,
                       "photo_flip_average": False, "raw_dims": 0},
    "finetune-lite1": {"backbone": "efficientnet-lite1", "image_size": 0, "finetune": True,
                       "photo_flip_average": False, "raw_dims": 0},
    "finetune-lite2": {"backbone": "efficientnet-lite2", "image_size": 0, "finetune": True,
                       "photo_flip_average": False, "raw_dims": 0},
}


# --smoke: the overrides that make a run take seconds on small data
SMOKE = {"modes": 4, "hidden": 16, "epochs": 1, "batch_size": 6, "image_size": 32, "k": 2,
         "gallery_queries": 2, "gallery_topk": 2}


def _parse_sets(items: list[str]) -> dict:
    """["lr=0.01", "finetune=true"] -> Config overrides, typed and checked by the same
    dashed-flag parser as ``python -m training.cdk``."""
    argv = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes FIELD=VALUE, got {item!r}")
        argv += ["--" + key.replace("_", "-"), value]
    return vars(cli.build_parser(Config, prog="--set").parse_args(argv))


def _record(name: str, seed: int, m: dict, wall: float) -> dict:
    full = m["map_all"]
    return {
        "variant": name, "seed": seed, "wall_seconds": wall,
        "train_seconds": m["train_seconds"],
        "valid_map": m["valid"]["map_all"] if m.get("valid") else None,
        "valid_p10": m["valid"]["precision_at_k"] if m.get("valid") else None,
        "test_map": full, "test_p10": m["precision_at_k"],
        "d16_share": m["map_by_dims"].get("16", float("nan")) / full if full else None,
        "max_swap_top32": m["spectrum_order"]["max_swap"],
        "rising_pairs_top32": m["spectrum_order"]["rising_pairs"],
        "map_by_dims": m["map_by_dims"],
        "valid_map_by_dims": m["valid"]["map_by_dims"] if m.get("valid") else None,
        "singular_values": m["singular_values"],
        "config": {k: v for k, v in m["config"].items() if k not in ("data", "out")},
    }


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def report(out: Path) -> str:
    """The table of every run in OUT/results.jsonl: one row per variant (mean over seeds)."""
    rows: dict[str, list[dict]] = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["variant"], []).append(r)
    lines = ["| variant | seeds | valid mAP | valid P@10 | test mAP | test P@10 | d=16 share "
             "| max swap top-32 | train s | wall s |", "|---" * 10 + "|"]
    for name, rs in rows.items():
        def mean(key, rs=rs):
            vals = [r[key] for r in rs if r[key] is not None]
            return float(np.mean(vals)) if vals else None

        seeds = ",".join(str(r["seed"]) for r in rs)
        lines.append(f"| {name} | {seeds} | {_fmt(mean('valid_map'))} | "
                     f"{_fmt(mean('valid_p10'))} | {_fmt(mean('test_map'))} | "
                     f"{_fmt(mean('test_p10'))} | {_fmt(mean('d16_share'))} | "
                     f"{_fmt(mean('max_swap_top32'))} | {mean('train_seconds'):.0f} | "
                     f"{mean('wall_seconds'):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    tune_allocator()
    p = argparse.ArgumentParser(prog="python -m research.cdk_finetune_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(p)
    p.add_argument("--out", default="runs/cdk-finetune-bench")
    p.add_argument("--split", default="sketchy2")
    p.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="more overrides for every variant of this call")
    p.add_argument("--tag", default="", help="appended to the variant names of this call")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--report", action="store_true", help="print the table and exit")
    p.add_argument("--smoke", action="store_true",
                   help="small heads, images and run: checks the benchmark, measures nothing")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(a.out)
    sets = {**(SMOKE if a.smoke else {}), **_parse_sets(a.set)}
    data = data_folder(p, a) if a.variants and not a.report else ""
    for seed in [] if a.report else a.seeds:
        for v in a.variants:
            name = v + (f" {a.tag}" if a.tag else "")
            run_dir = out / f"{name.replace(' ', '-')}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # time a fresh run, never a resume
            cfg = make_config("cpu", **{**VARIANTS[v], **sets, "data": data,
                                        "split": a.split, "seed": seed,
                                        "out": str(run_dir), "threads": a.threads})
            t0 = time.perf_counter()
            m = run(cfg)
            r = _record(name, seed, m, time.perf_counter() - t0)
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "results.jsonl", "a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(f"{name} seed {seed}: valid mAP {_fmt(r['valid_map'])}, test mAP "
                  f"{_fmt(r['test_map'])}, max swap {r['max_swap_top32']:.3f}, "
                  f"{r['wall_seconds']:.0f} s", flush=True)
    table = report(out)
    print(table)
    atomic_write_text(table + "\n", out / "table.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
