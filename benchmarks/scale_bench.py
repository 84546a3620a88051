"""Index kinds at 10^5 - 10^7 photos, simulated from the statistics of real embeddings.

    python -m benchmarks.scale_bench --index runs/index --data ../shared/data/sketchy-mini \
        --sizes 100000 1000000 10000000 --out runs/scale-bench

1. Fit (once, `OUT/stats.npz`): the photo embeddings of a real index (`--index`, a trained
   checkpoint's) and the sketch embeddings of `--sketches-per-class` sketches of each class
   of `--data` give a Gaussian class model: photo = m + c + w with class centres
   c ~ N(0, S_between) and w ~ N(0, S_within) (full covariances over the stored dims);
   sketch query = m_s + a * c + w_s (a: per-coordinate regression of the sketch class means
   on the photo class means, w_s ~ N(0, S_within_sketch)).
2. Simulate N photos of N / `--photos-per-class` classes into blocks of `--block` vectors
   (`OUT/n<N>/block-*.npy`, float32, written one block at a time), `--queries` sketch
   queries of random classes, and the exact top-10 of each query at each d (brute force over
   the blocks, one in memory at a time).
3. Per kind, in a fresh process (so peak memory is its own): build the index from the
   blocks as `index.build` does (`index.compressed.build_compressed`; nlist from N, the PQ
   kinds with `--pq-m` bytes), write it, open it as the service does (memory-mapped,
   `index.store.SERVE_IO_FLAGS`), then recall@10 against the exact top-10 and the latency of
   one query at a time (p50/p99 over the queries, one thread, after one warm-up pass) for
   each d and nprobe. "flat" is exact search (FAISS's inner-product scan, `faiss.knn`, with
   the zero-padded query, as IndexFlatIP runs it) over the memory-mapped blocks, which are
   the vectors of a flat index; not built as one, which at 10^7 would take 10 GB of RAM.

Results go to `OUT/results.jsonl` (a run skips what is there), the table to `OUT/table.md`
and the figure to `--plot` (default docs/scale.png).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "sketchy-mini"
DIMS = (16, 64, 256)
K = 10


def fit_stats(index_dir: Path, data: Path, per_class: int, out: Path) -> None:
    """Class model of the photo embeddings of `index_dir` and the sketch embeddings of
    `per_class` sketches per class of `data`, embedded with the index's checkpoint."""
    import torch

    from index.store import load_index
    from training.cdk.model.embedder import Embedder
    from training.folders import scan_paired
    from training.images import load_image

    torch.set_num_threads(2)
    ix = load_index(index_dir)
    photos = ix.index.reconstruct_n(0, len(ix)).astype(np.float64)  # (N, D)
    classes = sorted({p.cls for p in ix.photos})
    labels = np.array([classes.index(p.cls) for p in ix.photos])
    embedder = Embedder.from_checkpoint(ix.sidecar.checkpoint, device="cpu")
    if embedder.checkpoint_sha256 != ix.sidecar.checkpoint_sha256:
        raise ValueError(f"{ix.sidecar.checkpoint} is not the checkpoint of {index_dir}")
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
    s_labels = np.array(s_labels)

    def split(x, lab):
        means = np.stack([x[lab == c].mean(0) for c in range(len(classes))])  # (C, D)
        within = x - means[lab]
        return x.mean(0), means, np.cov(within.T), np.cov(means.T)

    m, p_means, p_within, p_between = split(photos, labels)
    m_s, s_means, s_within, _ = split(sketches, s_labels)
    centred_p, centred_s = p_means - p_means.mean(0), s_means - s_means.mean(0)
    a = (centred_p * centred_s).sum(0) / np.maximum((centred_p**2).sum(0), 1e-12)  # (D,)

    def factor(cov):  # F with F F^T = cov (clipped eigenvalues)
        w, v = np.linalg.eigh(cov)
        return (v * np.sqrt(np.clip(w, 0, None))).astype(np.float32)

    np.savez(out, m=m, m_s=m_s, a=a, between=factor(p_between), within=factor(p_within),
             within_s=factor(s_within), photo_var=photos.var(0), sketch_var=sketches.var(0),
             singular_values=np.asarray(embedder.singular_values)[: ix.dims],
             classes=len(classes), photos=len(photos), sketches=len(sketches))


def simulate(stats: dict, n: int, per_class: int, block: int, queries: int, folder: Path,
             seed: int = 0) -> None:
    """Blocks of simulated photo vectors and the sketch queries (with their classes)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dims = stats["m"].shape[0]
    n_classes = max(1, n // per_class)
    centres = (rng.standard_normal((n_classes, dims), dtype=np.float32)
               @ stats["between"].T)  # (C, D)
    for b, start in enumerate(range(0, n, block)):
        path = folder / f"block-{b:05d}.npy"
        if path.exists():
            continue
        r = np.random.default_rng([seed, b])
        count = min(block, n - start)
        x = centres[r.integers(0, n_classes, count)]
        x += r.standard_normal((count, dims), dtype=np.float32) @ stats["within"].T
        x += stats["m"].astype(np.float32)
        tmp = folder / f".{path.stem}.tmp.npy"  # np.save keeps a .npy suffix
        np.save(tmp, x.astype(np.float32))
        tmp.rename(path)
    q_classes = rng.integers(0, n_classes, queries)
    q = (stats["m_s"] + stats["a"] * centres[q_classes]
         + rng.standard_normal((queries, dims), dtype=np.float32) @ stats["within_s"].T)
    np.save(folder / "queries.npy", q.astype(np.float32))


def blocks_of(folder: Path):
    from index.compressed import Block

    out, start = [], 0
    for path in sorted(folder.glob("block-*.npy")):
        count = np.load(path, mmap_mode="r").shape[0]
        out.append(Block(path.stem, start, count,
                         lambda p=path: np.load(p, mmap_mode="r")))
        start += count
    return out


def ground_truth(folder: Path) -> None:
    """Exact top-K of every query at each d, over the blocks one at a time."""
    from index.search import exact_topk_blocks

    if all((folder / f"truth-{d}.npy").exists() for d in DIMS):
        return
    q = np.load(folder / "queries.npy")
    blocks = blocks_of(folder)
    for d in DIMS:
        _, rows = exact_topk_blocks(((b.start, b.load()[:, :d]) for b in blocks),
                                    np.ascontiguousarray(q[:, :d]), K)
        np.save(folder / f"truth-{d}.npy", rows)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(t) & set(f[f >= 0])) / K
                          for t, f in zip(truth, found, strict=True)]))


def latencies(search, q: np.ndarray, d: int, stored: int) -> np.ndarray:
    """Seconds of each single-query search (a warm-up pass first: pages mapped in)."""
    from index.search import pad_queries

    padded = pad_queries(np.ascontiguousarray(q[:, :d]), stored)
    for row in padded:
        search(row[None])
    times = []
    for row in padded:
        t = time.perf_counter()
        search(row[None])
        times.append(time.perf_counter() - t)
    return np.array(times)


def run_one(folder: Path, kind: str, nprobes: list[int], pq_m: int, flat_queries: int) -> dict:
    """Build, open and measure one kind over the blocks of `folder` (run in its own process)."""
    import faiss

    from index.compressed import Recipe, build_compressed, default_nlist
    from index.store import SERVE_IO_FLAGS

    faiss.omp_set_num_threads(2)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # interpreter + imports
    blocks = blocks_of(folder)
    n = sum(b.count for b in blocks)
    stored = blocks[0].load().shape[1]
    q = np.load(folder / "queries.npy")
    truth = {d: np.load(folder / f"truth-{d}.npy") for d in DIMS}
    rows = []
    if kind == "flat":
        faiss.omp_set_num_threads(1)
        qf = q[:flat_queries]
        loaded = [(b.start, b.load()) for b in blocks]  # memory-mapped (count, stored)

        def search(x):  # what IndexFlatIP.search does, block by block, without copies
            scores, rows = [], []
            for start, vectors in loaded:
                s, i = faiss.knn(x, vectors, K, metric=faiss.METRIC_INNER_PRODUCT)
                scores.append(s)
                rows.append(i + start)
            scores, rows = np.concatenate(scores, 1), np.concatenate(rows, 1)
            best = np.argsort(-scores, axis=1)[:, :K]
            return np.take_along_axis(scores, best, 1), np.take_along_axis(rows, best, 1)

        for d in DIMS:
            t = latencies(search, qf, d, stored)
            rows.append({"d": d, "nprobe": None, "recall": 1.0, "p50_ms": 1e3 * np.median(t),
                         "p99_ms": 1e3 * np.quantile(t, 0.99), "queries": len(qf)})
        return {"build_s": 0.0, "index_bytes": n * stored * 4, "peak_rss_bytes": None,
                "base_rss_bytes": base, "params": {}, "rows": rows}
    recipe = Recipe(kind, default_nlist(n), 0 if kind == "ivfsq8" else pq_m, max(nprobes))
    work = folder / f"work-{kind}"
    work.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    index = build_compressed(recipe, blocks, stored, work, progress=False)
    build_s = time.perf_counter() - t0
    path = folder / f"{kind}.faiss"
    faiss.write_index(index, str(path))
    del index
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for f in work.iterdir():
        f.unlink()
    index = faiss.read_index(str(path), SERVE_IO_FLAGS)
    ivf = faiss.extract_index_ivf(index)
    for nprobe in nprobes:
        ivf.nprobe = nprobe
        for d in DIMS:
            from index.search import pad_queries

            faiss.omp_set_num_threads(2)
            _, found = index.search(pad_queries(np.ascontiguousarray(q[:, :d]), stored), K)
            faiss.omp_set_num_threads(1)
            t = latencies(lambda x: index.search(x, K), q, d, stored)
            rows.append({"d": d, "nprobe": nprobe, "recall": recall(found, truth[d]),
                         "p50_ms": 1e3 * np.median(t), "p99_ms": 1e3 * np.quantile(t, 0.99),
                         "queries": len(q)})
    return {"build_s": build_s, "index_bytes": path.stat().st_size, "peak_rss_bytes": peak,
            "base_rss_bytes": base, "params": {"nlist": recipe.nlist, "m": recipe.m}, "rows": rows}


def table(results: list[dict], nprobe: int) -> str:
    lines = ["| N | kind | index memory | build | build peak RSS (- imports) | d | nprobe "
             "| recall@10 "
             "| p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["n"], r["kind"])):
        for row in r["rows"]:
            if row["nprobe"] not in (None, nprobe):
                continue
            peak = "-" if r["peak_rss_bytes"] is None else (
                f"{(r['peak_rss_bytes'] - r.get('base_rss_bytes', 0)) / 2**30:.2f} GiB")
            lines.append(
                f"| {r['n']:,} | {r['kind']} | {r['index_bytes'] / 2**30:.3f} GiB | "
                f"{r['build_s']:.0f} s | {peak} | {row['d']} | {row['nprobe'] or '-'} | "
                f"{row['recall']:.3f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], nprobe: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from training.files import atomic_savefig

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    kinds = sorted({r["kind"] for r in results})
    colours = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    styles = dict(zip(DIMS, (":", "-", "--"), strict=True))
    for kind in kinds:
        rs = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["n"])
        ns = [r["n"] for r in rs]
        axes[0].plot(ns, [r["index_bytes"] / 2**30 for r in rs], "o-", color=colours[kind],
                     label=kind)
        for d in DIMS:
            pick = [next(x for x in r["rows"] if x["d"] == d and x["nprobe"] in (None, nprobe))
                    for r in rs]
            kw = {"color": colours[kind], "ls": styles[d], "marker": "o"}
            if kind != "flat":
                axes[1].plot(ns, [p["recall"] for p in pick], label=f"{kind} d={d}", **kw)
            axes[2].plot(ns, [p["p50_ms"] for p in pick], label=f"{kind} d={d}", **kw)
    axes[0].legend(fontsize=8)
    axes[0].axhline(3, color="grey", lw=0.8, ls="--")
    axes[1].axhline(0.9, color="grey", lw=0.8, ls="--")
    axes[2].axhline(20, color="grey", lw=0.8, ls="--")
    for ax, title in zip(axes, ("index memory (GiB)", f"recall@10 vs exact (nprobe {nprobe})",
                                f"p50 latency per query, ms (1 thread, nprobe {nprobe})"),
                         strict=True):
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("photos N")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].legend(fontsize=6, ncol=2)
    fig.suptitle("simulated galleries (class model fitted to sketchy-mini embeddings of the "
                 "trained cpu preset, 256 dims)")
    fig.tight_layout()
    atomic_savefig(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, default=REPO / "runs" / "index")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--sketches-per-class", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--kinds", nargs="+", default=["flat", "ivfsq8", "ivfpq", "opq"])
    parser.add_argument("--nprobe", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--table-nprobe", type=int, default=64)
    parser.add_argument("--pq-m", type=int, default=64, help="bytes per photo of the PQ kinds")
    parser.add_argument("--photos-per-class", type=int, default=100)
    parser.add_argument("--block", type=int, default=250_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--flat-queries", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "scale-bench")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "scale.png")
    parser.add_argument("--one", nargs=2, metavar=("FOLDER", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        result = run_one(Path(args.one[0]), args.one[1], args.nprobe, args.pq_m,
                         args.flat_queries)
        print(json.dumps(result))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stats_path = args.out / "stats.npz"
    if not stats_path.exists():
        fit_stats(args.index, args.data, args.sketches_per_class, stats_path)
    stats = dict(np.load(stats_path))
    results_path = args.out / "results.jsonl"
    results = [json.loads(line) for line in results_path.read_text().splitlines()
               ] if results_path.exists() else []
    done = {(r["n"], r["kind"]) for r in results}
    for n in args.sizes:
        folder = args.out / f"n{n}"
        t0 = time.perf_counter()
        simulate(stats, n, args.photos_per_class, args.block, args.queries, folder)
        ground_truth(folder)
        print(f"N={n:,}: simulated and exact top-{K} in {time.perf_counter() - t0:.0f} s",
              flush=True)
        for kind in args.kinds:
            if (n, kind) in done:
                continue
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.scale_bench", "--one", str(folder), kind,
                 "--nprobe", *map(str, args.nprobe), "--pq-m", str(args.pq_m),
                 "--flat-queries", str(args.flat_queries)],
                cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{kind} at N={n} failed")
            result = {"n": n, "kind": kind, **json.loads(proc.stdout.strip().splitlines()[-1])}
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            results.append(result)
            best = [r for r in result["rows"] if r["nprobe"] in (None, args.table_nprobe)]
            print(f"  {kind}: {result['index_bytes'] / 2**30:.3f} GiB, build "
                  f"{result['build_s']:.0f} s, " + ", ".join(
                      f"d={r['d']} recall {r['recall']:.3f} p50 {r['p50_ms']:.2f} ms"
                      for r in best), flush=True)
    text = table(results, args.table_nprobe)
    (args.out / "table.md").write_text(text)
    print(text)
    plot(results, args.table_nprobe, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
