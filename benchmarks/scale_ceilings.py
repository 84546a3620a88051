"""Where an index of N photos loses the exact top 10: cells, codes, candidates. No index is
built; each stage is measured on its own over scale_bench's simulated gallery.

    python -m benchmarks.scale_ceilings --out runs/scale-bench --size 10000000

Needs `OUT/stats.npz` and `OUT/n<N>/` (queries, exact top 10 at d = 16 and 64) from
`benchmarks.scale_bench` run with the same --out and size. One pass over the N photos
(generated block by block, as scale_bench does) measures, for the exact top 10 of each
sketch query at d = 16 and 64:

- cells: the share whose cell is among the `nprobe` cells the query picks (by inner product
  with the centres), for k-means cells of the first 16 or 32 coordinates, clustered and
  assigned by Euclidean distance or by inner product; with the photos a query scans and the
  cells' imbalance (sum of squared sizes x nlist / N^2; 1 when even);
- codes: the share an exact ranking of the decoded codes finds (8-bit scalar codes of the
  first 64 coordinates; float16 of the first 16);
- candidates: the share among the R best by decoded 4-bit product codes of the leading
  coordinates (the scan of a `scanprefix` index), for one or two coordinates a code.

Writes `OUT/ceilings-<N>.json` and prints a table. `--smoke`: a tiny model (tests run it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.scale_bench import gallery, smoke_stats

DIMS = (16, 64)
NPROBES = (32, 64, 128, 256)
RERANKS = (300, 1000, 3000)
K = 10


class TopR:
    """The running top R rows of each query over blocks of scores."""

    def __init__(self, queries: int, r: int):
        self.r, self.scores = r, np.full((queries, 0), -np.inf, np.float32)
        self.rows = np.zeros((queries, 0), np.int64)

    def add(self, scores: np.ndarray, start: int) -> None:
        """Merge a block's scores (queries, rows from `start`): its own top R first, so no
        row numbers are made for the whole block."""
        import torch

        block = torch.topk(torch.from_numpy(scores), min(self.r, scores.shape[1]), dim=1)
        s = np.concatenate([self.scores, block.values.numpy()], 1)
        rows = np.concatenate([self.rows, start + block.indices.numpy()], 1)
        top = torch.topk(torch.from_numpy(s), min(self.r, s.shape[1]), dim=1)
        self.scores = top.values.numpy()
        self.rows = np.take_along_axis(rows, top.indices.numpy(), 1)


def share(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each query's exact top 10 among its found rows."""
    return float(np.mean([np.isin(t, f).mean() for t, f in zip(truth, found, strict=True)]))


def run(out: Path, n: int, per_class: int, block: int, nlist: int, seed: int = 0) -> dict:
    import faiss

    from index.blocks import sample_vectors

    stats = dict(np.load(out / "stats.npz"))
    blocks, _ = gallery(stats, n, per_class, block)
    folder = out / f"n{n}"
    q = np.load(folder / "queries.npy")
    truth = {d: np.load(folder / f"truth-{d}.npy") for d in DIMS}
    width = len(stats["m"])
    sample = sample_vectors(blocks, max(64 * nlist, 65_536), seed)
    cells = {}
    for coarse in (16, 32):
        for metric in ("l2", "ip"):
            clustering = faiss.Clustering(coarse, nlist)
            clustering.niter, clustering.seed = 20, 1234
            index = faiss.IndexFlatL2(coarse) if metric == "l2" else faiss.IndexFlatIP(coarse)
            clustering.train(np.ascontiguousarray(sample[:, :coarse]), index)
            centres = faiss.vector_to_array(clustering.centroids).reshape(nlist, coarse)
            assign = faiss.IndexFlatL2(coarse) if metric == "l2" else faiss.IndexFlatIP(coarse)
            assign.add(centres)
            cells[(coarse, metric)] = (centres, assign, np.empty(n, np.int64))
    lead = min(64, width)
    sq8 = faiss.ScalarQuantizer(lead, faiss.ScalarQuantizer.QT_8bit)
    sq8.train(np.ascontiguousarray(sample[:, :lead]))
    pqs = {}
    for name, scan, per_code in (("32 coords, 1 a code", 32, 1), ("32 coords, 2 a code", 32, 2),
                                 ("64 coords, 2 a code", 64, 2)):
        scan = min(scan, width)
        pq = faiss.ProductQuantizer(scan, scan // per_code, 4)
        pq.train(np.ascontiguousarray(sample[:, :scan]))
        pqs[name] = (scan, pq)
    codes = {("8-bit", d): TopR(len(q), K) for d in DIMS} | {("float16", 16): TopR(len(q), K)}
    cands = {(name, d): TopR(len(q), max(RERANKS)) for name in pqs for d in DIMS}
    t0 = time.perf_counter()
    for b in blocks:
        x = b.load()
        for centres, assign, owner in cells.values():
            owner[b.start : b.start + b.count] = assign.assign(
                np.ascontiguousarray(x[:, : centres.shape[1]]), 1).ravel()
        decoded = sq8.decode(sq8.compute_codes(np.ascontiguousarray(x[:, :lead])))
        for d in DIMS:
            codes[("8-bit", d)].add(q[:, :d] @ decoded[:, :d].T, b.start)
        half = x[:, :16].astype(np.float16).astype(np.float32)
        codes[("float16", 16)].add(q[:, :16] @ half.T, b.start)
        for name, (scan, pq) in pqs.items():
            approx = pq.decode(pq.compute_codes(np.ascontiguousarray(x[:, :scan])))
            for d in DIMS:
                m = min(d, scan)
                cands[(name, d)].add(q[:, :m] @ approx[:, :m].T, b.start)
        print(f"  rows to {b.start + b.count:,}: {time.perf_counter() - t0:.0f} s", flush=True)
    result = {"n": n, "nlist": nlist, "cells": [], "codes": [], "candidates": []}
    for (coarse, metric), (centres, _, owner) in cells.items():
        sizes = np.bincount(owner, minlength=nlist).astype(np.float64)
        picker = faiss.IndexFlatIP(coarse)  # queries pick cells by inner product
        picker.add(centres)
        row = {"coarse": coarse, "metric": metric,
               "imbalance": float((sizes**2).sum() * nlist / n**2), "by_nprobe": []}
        for nprobe in NPROBES:
            entry = {"nprobe": nprobe}
            for d in DIMS:
                padded = np.zeros((len(q), coarse), np.float32)
                padded[:, : min(d, coarse)] = q[:, : min(d, coarse)]
                _, probe = picker.search(padded, min(nprobe, nlist))
                entry[f"d{d}"] = share(probe, owner[truth[d]])
                entry[f"scanned_d{d}"] = float(np.mean(sizes[probe].sum(1)))
            row["by_nprobe"].append(entry)
        result["cells"].append(row)
    for (name, d), top in codes.items():
        result["codes"].append({"codes": name, "d": d, "recall": share(top.rows, truth[d])})
    for (name, d), top in cands.items():
        result["candidates"].append({"codes": name, "d": d, **{
            f"R{r}": share(top.rows[:, :r], truth[d]) for r in RERANKS}})
    return result


def table(result: dict) -> str:
    lines = [f"N = {result['n']:,}, {result['nlist']:,} cells", "",
             "| cells | imbalance | " + " | ".join(f"d = {d}, nprobe {p}" for d in DIMS
                                                   for p in NPROBES) + " |",
             "|---|---|" + "---|" * (len(DIMS) * len(NPROBES))]
    for row in result["cells"]:
        by = {e["nprobe"]: e for e in row["by_nprobe"]}
        lines.append(f"| first {row['coarse']}, {row['metric']} | {row['imbalance']:.2f} | "
                     + " | ".join(f"{by[p][f'd{d}']:.3f} ({by[p][f'scanned_d{d}'] / 1e3:.0f}k)"
                                  for d in DIMS for p in NPROBES) + " |")
    lines += ["", "| codes, exact ranking | d | recall@10 |", "|---|---|---|"]
    lines += [f"| {r['codes']} | {r['d']} | {r['recall']:.3f} |" for r in result["codes"]]
    lines += ["", "| candidates (4-bit product codes) | d | "
              + " | ".join(f"in best {r}" for r in RERANKS) + " |",
              "|---|---|" + "---|" * len(RERANKS)]
    lines += [f"| {r['codes']} | {r['d']} | " + " | ".join(f"{r[f'R{x}']:.3f}" for x in RERANKS)
              + " |" for r in result["candidates"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_ceilings",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="scale_bench's --out")
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--nlist", type=int, default=0, help="cells (default: as the IVF "
                        "kinds plan them, a power of two near sqrt(N))")
    parser.add_argument("--photos-per-class", type=int, default=100)
    parser.add_argument("--block", type=int, default=250_000)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and gallery")
    args = parser.parse_args(argv)
    if args.smoke:
        from benchmarks.scale_bench import main as scale_main

        args.out.mkdir(parents=True, exist_ok=True)
        smoke_stats(args.out / "stats.npz", dims=64)
        scale_main(["--smoke", "--out", str(args.out), "--kinds", "flat"])
        args.size, args.block, args.photos_per_class = 2000, 700, 20
    from index.kinds.codes import default_nlist

    nlist = args.nlist or default_nlist(args.size)
    result = run(args.out, args.size, args.photos_per_class, args.block, nlist)
    (args.out / f"ceilings-{args.size}.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
