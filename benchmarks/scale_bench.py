"""Index kinds at 10^5 - 10^7 photos of today's width, simulated from real embeddings.

    python -m benchmarks.scale_bench --index runs/index --data DIR \
        --sizes 100000 1000000 10000000 --kinds flat ivfsq8 ivfsq48 opq --budget 3G \
        --out runs/scale-bench

1. Fit (once, `OUT/stats.npz`): the stored photo vectors of a real index (`--index`, a
   trained checkpoint's, all its dims) and the sketch embeddings of `--sketches-per-class`
   sketches of each class of `--data` (the sketch/photo folder; default $SKETCHY_DATA) give a
   Gaussian class model: photo = m + c + w with class centres c ~ N(0, S_between) and
   w ~ N(0, S_within) (full covariances over the stored dims); sketch query =
   m_s + a * c + w_s (a: per-coordinate regression of the sketch class means on the photo
   class means, w_s ~ N(0, S_within_sketch)).
2. N photos of N / `--photos-per-class` classes in blocks of `--block` vectors, each block
   generated from its own seed whenever it is read (nothing of size N is stored: 10^7 photos
   512 wide are 20 GB), `--queries` sketch queries of random classes, and the exact top-10
   of each query at each d (brute force, block by block; `OUT/n<N>/truth-<d>.npy`).
3. Per kind, in a fresh process (its peak memory its own): the kind's parameters as
   `index.build` plans them for N vectors within `--budget` (`index.kinds`), built from the
   blocks as the sharded build does (`Kind.build`), written, opened memory-mapped as the
   service opens it (`index.store.SERVE_IO_FLAGS`), then recall@10 against the exact top-10
   and the latency of one query at a time (one thread, after a warm-up pass) per d and
   nprobe, and of one query as `/retrieve` serves it (expanded with its best photos and
   its pool of candidates re-scored: training.cdk.model.smoothing.expanded_search), with
   the share of its top 10 that a second full search would return. "flat" is exact: recall 1,
   its latency measured where its vectors fit in memory (`--flat-max`). A kind can be given
   parameters: `ivfsq48:coarse=16,lead=64`.

`--smoke` runs all of it on a tiny random class model (no index needed) into `--out`.
Results go to `OUT/results.jsonl` (a run skips what is there), the table to `OUT/table.md`
and the figure to `--plot` (default: OUT/scale.png).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = os.environ.get("SKETCHY_DATA")  # the sketch/photo folder when --data is not given
K = 10


def fit_stats(index_dir: Path, data: Path, per_class: int, out: Path) -> None:
    """Class model of the stored photo vectors of `index_dir` and the sketch embeddings of
    `per_class` sketches per class of `data`, embedded with the index's model bundle."""
    import torch

    from index.store import load_index
    from training.cdk.model.bundle import Bundle
    from training.folders import scan_paired
    from training.images import load_image

    torch.set_num_threads(2)
    ix = load_index(index_dir)
    photos = ix.kind.reconstruct(ix.index, 0, len(ix)).astype(np.float64)  # (N, D)
    classes = sorted({p.cls for p in ix.photos})
    labels = np.array([classes.index(p.cls) for p in ix.photos])
    model = Bundle.open(ix.sidecar.model)
    if model.sha256 != ix.sidecar.model_sha256:
        raise ValueError(f"{ix.sidecar.model} is not the model bundle of {index_dir}")
    embedder = model.embedder("cpu")
    sketch_files, _ = scan_paired(data)  # {class: sketch files}
    files, s_labels = [], []
    for c, name in enumerate(classes):
        for f in sorted(sketch_files.get(name, []))[:per_class]:
            files.append(f)
            s_labels.append(c)
    print(f"embedding {len(files)} sketches of {len(classes)} classes", flush=True)
    sketches = np.concatenate([
        embedder.embed([load_image(f) for f in files[i : i + 64]], "sketch")
        for i in range(0, len(files), 64)]).astype(np.float64)[:, : ix.dims]
    fit_model(photos, labels, sketches, np.array(s_labels), out,
              extra={"modes": ix.sidecar.modes, "smoothing": json.dumps(ix.sidecar.smoothing)})


def fit_model(photos: np.ndarray, labels: np.ndarray, sketches: np.ndarray,
              s_labels: np.ndarray, out: Path, extra: dict | None = None) -> None:
    """The class model of step 1 from photo (N, D) and sketch (S, D) vectors and classes."""
    classes = int(labels.max()) + 1

    def split(x, lab):
        means = np.stack([x[lab == c].mean(0) for c in range(classes)])  # (C, D)
        return x.mean(0), means, np.cov((x - means[lab]).T), np.cov(means.T)

    m, p_means, p_within, p_between = split(photos, labels)
    m_s, s_means, s_within, _ = split(sketches, s_labels)
    centred_p, centred_s = p_means - p_means.mean(0), s_means - s_means.mean(0)
    a = (centred_p * centred_s).sum(0) / np.maximum((centred_p**2).sum(0), 1e-12)  # (D,)

    def factor(cov):  # F with F F^T = cov (clipped eigenvalues)
        w, v = np.linalg.eigh(cov)
        return (v * np.sqrt(np.clip(w, 0, None))).astype(np.float32)

    np.savez(out, m=m, m_s=m_s, a=a, between=factor(p_between), within=factor(p_within),
             within_s=factor(s_within), photo_var=photos.var(0), sketch_var=sketches.var(0),
             classes=classes, photos=len(photos), sketches=len(sketches), **(extra or {}))


def smoke_stats(out: Path, dims: int = 24, seed: int = 0) -> None:
    """A tiny class model with a falling spectrum (for --smoke): no index needed."""
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(np.arange(1, dims + 1))
    centres = rng.standard_normal((30, dims))
    labels = np.arange(600) % 30
    photos = (centres[labels] + 0.5 * rng.standard_normal((600, dims))) * scale
    sketches = (0.7 * centres[labels[:300]] + rng.standard_normal((300, dims))) * scale
    fit_model(photos, labels, sketches, labels[:300], out, extra={"modes": dims // 2})


def simulate_block(stats: dict, centres: np.ndarray, n: int, block: int, b: int,
                   seed: int = 0) -> np.ndarray:
    """Block b (rows b*block ...) of the N simulated photo vectors, from its own seed."""
    r = np.random.default_rng([seed, b])
    count = min(block, n - b * block)
    dims = stats["m"].shape[0]
    x = centres[r.integers(0, len(centres), count)]
    x += r.standard_normal((count, dims), dtype=np.float32) @ stats["within"].T
    x += stats["m"].astype(np.float32)
    return x


def gallery(stats: dict, n: int, per_class: int, block: int, seed: int = 0):
    """(blocks of the N photo vectors, class centres (C, D))."""
    from index.blocks import Block

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // per_class), stats["m"].shape[0]),
                                  dtype=np.float32) @ stats["between"].T  # (C, D)
    blocks = [Block(f"sim-{n}-{b}", b * block, min(block, n - b * block),
                    partial(simulate_block, stats, centres, n, block, b, seed))
              for b in range((n + block - 1) // block)]
    return blocks, centres


def queries_and_truth(stats: dict, n: int, per_class: int, block: int, count: int,
                      dims_list: list[int], folder: Path) -> None:
    """The sketch queries (`folder`/queries.npy) and their exact top-K per d."""
    from index.blocks import iter_arrays
    from index.search import exact_topk_blocks

    folder.mkdir(parents=True, exist_ok=True)
    if all((folder / f"truth-{d}.npy").exists() for d in dims_list):
        return
    blocks, centres = gallery(stats, n, per_class, block)
    rng = np.random.default_rng(1)
    q_classes = rng.integers(0, len(centres), count)
    q = (stats["m_s"] + stats["a"] * centres[q_classes]
         + rng.standard_normal((count, len(stats["m"])), dtype=np.float32) @ stats["within_s"].T)
    np.save(folder / "queries.npy", q.astype(np.float32))
    best = {d: (np.full((count, 0), -np.inf, np.float32), np.zeros((count, 0), np.int64))
            for d in dims_list}
    for start, x in iter_arrays(blocks):  # each block generated once, every d scored
        for d in dims_list:
            s, i = exact_topk_blocks([(start, x[:, :d])], np.ascontiguousarray(q[:, :d]), K)
            s, i = np.concatenate([best[d][0], s], 1), np.concatenate([best[d][1], i], 1)
            top = np.argsort(-s, axis=1, kind="stable")[:, :K]
            best[d] = (np.take_along_axis(s, top, 1), np.take_along_axis(i, top, 1))
    for d in dims_list:
        np.save(folder / f"truth-{d}.npy", best[d][1])


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(t) & set(f[f >= 0])) / K
                          for t, f in zip(truth, found, strict=True)]))


def latencies(search, q: np.ndarray) -> np.ndarray:
    """Seconds of each single-query search (a warm-up pass first: pages mapped in)."""
    for row in q:
        search(row[None])
    times = []
    for row in q:
        t = time.perf_counter()
        search(row[None])
        times.append(time.perf_counter() - t)
    return np.array(times)


def parse_kind(spec: str) -> tuple[str, dict]:
    """'ivfsq48:coarse=16,lead=64' -> ('ivfsq48', {'coarse': 16, 'lead': 64})."""
    name, _, rest = spec.partition(":")
    return name, {k: int(v) for k, v in (p.split("=") for p in rest.split(",") if p)}


def run_one(folder: Path, spec: str, args) -> dict:
    """Build, open and measure one kind over the simulated gallery (in its own process)."""
    import faiss

    from index.blocks import concat
    from index.kinds import get, parse_bytes
    from index.store import SERVE_IO_FLAGS

    faiss.omp_set_num_threads(args.threads)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # interpreter + imports
    stats = dict(np.load(args.out / "stats.npz"))
    n = int(folder.name[1:])
    blocks, _ = gallery(stats, n, args.photos_per_class, args.block)
    dims = len(stats["m"])
    q = np.load(folder / "queries.npy")
    name, overrides = parse_kind(spec)
    kind = get(name)
    budget = parse_bytes(args.budget) if args.budget else None
    params = {**kind.plan(n, dims, None if overrides else budget, max(args.nprobe)),
              **overrides}
    out = {"params": params, "base_rss_bytes": base, "rows": [],
           "index_bytes": kind.memory(n, dims, params), "build_s": 0.0, "peak_rss_bytes": None}
    if kind.exact:
        if n > args.flat_max:
            out["rows"] = [{"d": d, "nprobe": None, "recall": 1.0, "p50_ms": None,
                            "p99_ms": None} for d in args.dims]
            return out
        index = kind.build_vectors(concat(blocks), params)
    else:
        t0 = time.perf_counter()
        index = kind.build(blocks, dims, params, work=None)
        out["build_s"] = time.perf_counter() - t0
        path = folder / f"{spec.replace(':', '_')}.faiss"
        faiss.write_index(index, str(path))
        del index
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["index_bytes"] = path.stat().st_size
        index = faiss.read_index(str(path), SERVE_IO_FLAGS)
        path.unlink()  # the mapping stays valid
    out["rows"] = measure(kind, index, q, folder, args)
    return out


def measure(kind, index, q: np.ndarray, folder: Path, args) -> list[dict]:
    import faiss

    rows = []
    cells = not kind.exact and faiss.try_extract_index_ivf(index) is not None
    for nprobe in (args.nprobe if cells else [None]):
        if nprobe is not None:
            faiss.extract_index_ivf(index).nprobe = nprobe
        for d in args.dims:
            qd = np.ascontiguousarray(q[:, :d])
            faiss.omp_set_num_threads(args.threads)
            _, found = kind.search(index, qd, K)
            faiss.omp_set_num_threads(1)
            t = latencies(lambda x, d=d: kind.search(index, x, K), qd[: args.timed_queries])
            timed = qd[: args.timed_queries]
            served = latencies(lambda x: served_search(kind, index, x), timed)
            rescored, full = (served_search(kind, index, timed, r)[1] for r in (None, 0))
            rows.append({"d": d, "nprobe": nprobe,
                         "recall": recall(found, np.load(folder / f"truth-{d}.npy")),
                         "p50_ms": 1e3 * np.median(t), "p99_ms": 1e3 * np.quantile(t, 0.99),
                         "p50_served_ms": 1e3 * np.median(served),
                         "served_same": recall(rescored, full), "queries": len(qd)})
    return rows


def served_search(kind, index, q: np.ndarray, rescore: int | None = None):
    """What `/retrieve` does with a query: expanded with its best photos (the default
    Expansion), its pool of candidates re-scored (None: the service's default; 0: a second
    full search instead), its top K."""
    from training.cdk.model.smoothing import RESCORE, Expansion, expanded_search

    return expanded_search(q, K, lambda x, n: kind.search(index, x, n),
                           lambda rows, d: kind.vectors(index, rows, d),
                           lambda x, n: kind.pool(index, x, n), Expansion(),
                           RESCORE if rescore is None else rescore)


def table(results: list[dict], nprobe: int) -> str:
    lines = ["| N | kind | params | index size | build | build peak RSS (- imports) | d | "
             "nprobe | recall@10 | p50 ms | p99 ms | p50 ms as served | served top 10 as "
             "a full second search |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    for r in sorted(results, key=lambda r: (r["n"], r["kind"])):
        for row in r["rows"]:
            if row["nprobe"] not in (None, nprobe):
                continue
            peak = "-" if r["peak_rss_bytes"] is None else (
                f"{(r['peak_rss_bytes'] - r['base_rss_bytes']) / 2**30:.2f} GiB")
            params = ", ".join(f"{k} {v}" for k, v in r["params"].items() if k != "nprobe")
            same = "-" if row.get("served_same") is None else f"{row['served_same']:.3f}"
            lines.append(
                f"| {r['n']:,} | {r['kind']} | {params} | {r['index_bytes'] / 2**30:.3f} GiB | "
                f"{r['build_s']:.0f} s | {peak} | {row['d']} | {row['nprobe'] or '-'} | "
                f"{row['recall']:.3f} | {ms(row['p50_ms'])} | {ms(row['p99_ms'])} | "
                f"{ms(row.get('p50_served_ms'))} | {same} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], nprobe: int, dims_list: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from training.files import atomic_savefig

    fig, axes = plt.subplots(1, 3, figsize=(15, 6))
    kinds = sorted({r["kind"] for r in results})
    colours = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    styles = dict(zip(dims_list, (":", "-", "--", "-."), strict=False))
    for kind in kinds:
        rs = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["n"])
        ns = [r["n"] for r in rs]
        axes[0].plot(ns, [r["index_bytes"] / 2**30 for r in rs], "o-", color=colours[kind],
                     label=kind)
        for d in dims_list:
            pick = [next(x for x in r["rows"] if x["d"] == d and x["nprobe"] in (None, nprobe))
                    for r in rs]
            kw = {"color": colours[kind], "ls": styles.get(d, "-"), "marker": "o"}
            if any(p["recall"] < 1 for p in pick):
                axes[1].plot(ns, [p["recall"] for p in pick], label=f"{kind} d={d}", **kw)
            timed = [(n, p["p50_ms"]) for n, p in zip(ns, pick, strict=True) if p["p50_ms"]]
            if timed:
                axes[2].plot(*zip(*timed, strict=True), label=f"{kind} d={d}", **kw)
    axes[0].axhline(3, color="grey", lw=0.8, ls="--")
    axes[1].axhline(0.9, color="grey", lw=0.8, ls="--")
    axes[2].axhline(20, color="grey", lw=0.8, ls="--")
    for ax, title in zip(axes, ("index size (GiB)", f"recall@10 vs exact (nprobe {nprobe})",
                                f"p50 latency per query, ms (1 thread, nprobe {nprobe})"),
                         strict=True):
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("photos N")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    fig.suptitle("simulated galleries (class model fitted to sketchy-mini embeddings of the "
                 f"trained default checkpoint, {max(dims_list)} dims)")
    fig.tight_layout()
    atomic_savefig(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, default=REPO / "runs" / "index")
    parser.add_argument("--data", type=Path, default=DATA, metavar="DIR",
                        help="the sketch/photo folder the class model's sketches come from "
                             "(default: $SKETCHY_DATA)")
    parser.add_argument("--sketches-per-class", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--kinds", nargs="+", default=["flat", "ivfsq8", "ivfsq48", "opq"])
    parser.add_argument("--budget", default="3G", help="memory budget the kinds are planned "
                        "in, as --max-index-memory (empty: none)")
    parser.add_argument("--dims", type=int, nargs="+", default=None,
                        help="query prefixes measured (default: 16, 64 and the stored dims)")
    parser.add_argument("--nprobe", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--table-nprobe", type=int, default=64)
    parser.add_argument("--photos-per-class", type=int, default=100)
    parser.add_argument("--block", type=int, default=250_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--timed-queries", type=int, default=200)
    parser.add_argument("--flat-max", type=int, default=1_000_000,
                        help="largest N at which the flat kind is built and timed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "scale-bench")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny random class model, 2,000 photos, every kind")
    parser.add_argument("--one", nargs=2, metavar=("FOLDER", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.block, args.queries, args.timed_queries = [2000], 700, 20, 5
        args.photos_per_class, args.nprobe, args.table_nprobe = 20, [4, 16], 16
        args.kinds = ["flat", "ivfsq48", "ivfsq48:coarse=4"]
    elif args.data is None and not (args.out / "stats.npz").exists():
        parser.error("fitting the class model needs the sketches: give --data DIR or set "
                     "SKETCHY_DATA=DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(Path(args.one[0]), args.one[1], args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stats_path = args.out / "stats.npz"
    if not stats_path.exists():
        (smoke_stats if args.smoke else partial(fit_stats, args.index, args.data,
                                                args.sketches_per_class))(stats_path)
    stats = dict(np.load(stats_path))
    width = len(stats["m"])
    dims_list = args.dims or sorted({d for d in (16, 64) if d < width} | {width})
    passed = [*(argv or sys.argv[1:])]
    results_path = args.out / "results.jsonl"
    results = [json.loads(line) for line in results_path.read_text().splitlines()
               ] if results_path.exists() else []
    done = {(r["n"], r["kind"]) for r in results}
    for n in args.sizes:
        folder = args.out / f"n{n}"
        t0 = time.perf_counter()
        queries_and_truth(stats, n, args.photos_per_class, args.block, args.queries, dims_list,
                          folder)
        print(f"N={n:,}: queries and exact top-{K} in {time.perf_counter() - t0:.0f} s",
              flush=True)
        for spec in args.kinds:
            if (n, spec) in done:
                continue
            result = {"n": n, "kind": spec, **_in_child(folder, spec, passed, dims_list)}
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            results.append(result)
            best = [r for r in result["rows"] if r["nprobe"] in (None, args.table_nprobe)]
            print(f"  {spec} {result['params']}: {result['index_bytes'] / 2**30:.3f} GiB, "
                  f"build {result['build_s']:.0f} s, " + ", ".join(
                      f"d={r['d']} recall {r['recall']:.3f} p50 {r['p50_ms'] or 0:.2f} ms"
                      for r in best), flush=True)
    text = table(results, args.table_nprobe)
    (args.out / "table.md").write_text(text)
    print(text)
    plot(results, args.table_nprobe, dims_list, args.plot or args.out / "scale.png")
    return 0


def _in_child(folder: Path, spec: str, passed: list[str], dims_list: list[int]) -> dict:
    """run_one in a fresh process (the same flags), so its peak memory is its own."""
    cmd = [sys.executable, "-m", "benchmarks.scale_bench", *passed, "--one", str(folder), spec,
           "--dims", *map(str, dims_list)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{spec} at N={folder.name[1:]} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
