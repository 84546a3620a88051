"""The photo table at 10^6 and 10^7 photos: JSON lines read into Python objects (the
former loader of `meta.jsonl`) against the columnar table mapped read only (`index.table`),
side by side.

    python -m benchmarks.photo_table_bench --sizes 1000000 10000000 --out runs/photo-table-bench

1. Write N synthetic rows (`OUT/n<N>/`, skipped when there) both ways: `meta.jsonl` as the
   former IndexWriter wrote it (one json.dumps object a row) and the table
   (`index.table.write_table`, fed by a generator). Rows in gallery order, N /
   `--photos-per-class` classes named `class_00000`...; ids like Sketchy's `n02691156_10151`
   (a WordNet-style id per class and a running number); paths `photo/<class>/<id>.jpg`.
2. Each loader in a fresh process (so its memory is its own), its files first evicted from
   the page cache (fsync, then posix_fadvise DONTNEED), so that loading reads the disk:
   - `meta`: the code this table replaced: every line json-parsed into a Photo, its path
     checked with PurePosixPath, then an id -> row dict;
   - `table`: `PhotoTable.open`, memory-mapped.
   Reported: load seconds; RSS after the load less RSS before (VmRSS, and its anonymous and
   file-backed parts); peak RSS (VmHWM) less RSS before.
3. Per query, what the service does with a query's results: `--k` random rows -> (id, class)
   of each (`RetrievalEngine._hits`), and one id -> row lookup (`GET /photos/{id}`); over
   `--queries` queries, the table's pages evicted first (cold), then the same queries again
   (warm). p50 / p99 in microseconds, and RSS after both passes (the table's file-backed
   pages: those the queries touched and the kernel's read-around of them).

Results go to `OUT/results.jsonl` (a run skips what is there) and the table to `OUT/table.md`.
`--smoke` runs it all on 2,000 rows into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LOADERS = ("meta", "table")
LABELS = {"meta": "meta.jsonl, former loader (objects + id dict)",
          "table": "table, memory-mapped"}
META_FILE = "meta.jsonl"  # one JSON object a row, as the former index writer wrote them


def synthetic(n: int, per_class: int):
    """Photo rows 0..n-1 in gallery order (class by class)."""
    from index.gallery import Photo

    for i in range(n):
        yield Photo(*_row(i, per_class))


def _row(i: int, per_class: int) -> tuple[str, str, str]:
    c, j = divmod(i, per_class)
    cls = f"class_{c:05d}"
    pid = f"n{2_000_000 + 7919 * c:08d}_{10_000 + j}"
    return pid, cls, f"photo/{cls}/{pid}.jpg"


def write_both(folder: Path, n: int, per_class: int) -> dict:
    """meta.jsonl and the table of n synthetic rows in `folder` (once); their write times
    and sizes."""
    from index.table import TABLE_FILES, write_table

    done = folder / "written.json"
    if done.exists():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    for name in (META_FILE, *TABLE_FILES):
        (folder / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(folder / META_FILE, "w", encoding="utf-8") as f:  # as the former commit did
        for p in synthetic(n, per_class):
            f.write(json.dumps({"id": p.id, "class": p.cls, "path": p.path}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    meta_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_table(folder, synthetic(n, per_class))
    table_s = time.perf_counter() - t0
    info = {"meta_write_s": meta_s, "table_write_s": table_s,
            "meta_bytes": (folder / META_FILE).stat().st_size,
            "table_bytes": sum((folder / name).stat().st_size for name in TABLE_FILES)}
    done.write_text(json.dumps(info))
    return info


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages no process maps)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memory() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def former_load(path: Path):
    """The loader this table replaced (index.store before it): rows as Photo objects with
    every path checked by PurePosixPath, and the id -> row dict of GalleryIndex."""
    from index.gallery import Photo

    photos = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            photos.append(Photo(id=row["id"], cls=row["class"], path=row["path"]))
            p = photos[-1].path
            if (not isinstance(p, str) or not p or PurePosixPath(p).is_absolute()
                    or ".." in PurePosixPath(p).parts or "\0" in p):
                raise ValueError(f"line {len(photos)}: photo path {p!r} leaves the root")
    return photos, {p.id: i for i, p in enumerate(photos)}


def measure(folder: Path, loader: str, k: int, queries: int, per_class: int) -> dict:
    """Load the rows of `folder` with `loader`, then time the per-query lookups (run in its
    own process)."""
    from index.table import TABLE_FILES, PhotoTable

    files = [folder / META_FILE] if loader != "table" else [folder / n for n in TABLE_FILES]
    evict(files)
    before = memory()
    t0 = time.perf_counter()
    if loader == "meta":
        photos, by_id = former_load(folder / META_FILE)
        row_of = by_id.get
    else:
        photos = PhotoTable.open(folder)
        row_of = photos.row_of
    load_s = time.perf_counter() - t0
    loaded = memory()
    n = len(photos)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, n, (queries, k))  # (Q, k) int64, as FAISS returns them
    ids = [_row(int(r), per_class)[0] for r in rng.integers(0, n, queries)]
    if loader == "table":
        evict(files)  # the loader read a few pages; the queries start cold
    passes = {}
    for name in ("cold", "warm"):
        hit_t, id_t = [], []
        for q, pid in zip(rows, ids, strict=True):
            t = time.perf_counter()
            hits = [(p.id, p.cls) for p in (photos[r] for r in q)]  # as RetrievalEngine._hits
            hit_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            row = row_of(pid)
            id_t.append(time.perf_counter() - t)
            assert len(hits) == k and row is not None
        passes[name] = {"hits_p50_us": 1e6 * np.median(hit_t),
                        "hits_p99_us": 1e6 * np.quantile(hit_t, 0.99),
                        "id_p50_us": 1e6 * np.median(id_t),
                        "id_p99_us": 1e6 * np.quantile(id_t, 0.99)}
    after = memory()
    return {"rows": n, "load_s": load_s,
            "rss_bytes": loaded["VmRSS"] - before["VmRSS"],
            "anon_bytes": loaded["RssAnon"] - before["RssAnon"],
            "file_bytes": loaded["RssFile"] - before["RssFile"],
            "peak_bytes": loaded["VmHWM"] - before["VmRSS"],
            "rss_after_queries_bytes": after["VmRSS"] - before["VmRSS"],
            "anon_after_queries_bytes": after["RssAnon"] - before["RssAnon"],
            "file_after_queries_bytes": after["RssFile"] - before["RssFile"], "passes": passes}


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = ["| N | photo table | load s | RSS + MiB (anon / file) | peak + MiB | k=10 rows "
             "p50 / p99 us (cold; warm) | id -> row p50 us (cold; warm) | RSS + MiB after "
             "queries (anon / file) |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["n"], LOADERS.index(r["loader"]))):
        c, w = r["passes"]["cold"], r["passes"]["warm"]
        lines.append(
            f"| {r['n']:,} | {LABELS[r['loader']]} | {r['load_s']:.3g} | "
            f"{r['rss_bytes'] / mib:.1f} ({r['anon_bytes'] / mib:.1f} / "
            f"{r['file_bytes'] / mib:.1f}) | {r['peak_bytes'] / mib:.1f} | "
            f"{c['hits_p50_us']:.1f} / {c['hits_p99_us']:.1f}; {w['hits_p50_us']:.1f} / "
            f"{w['hits_p99_us']:.1f} | {c['id_p50_us']:.1f}; {w['id_p50_us']:.1f} | "
            f"{r['rss_after_queries_bytes'] / mib:.1f} ({r['anon_after_queries_bytes'] / mib:.1f}"
            f" / {r['file_after_queries_bytes'] / mib:.1f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.photo_table_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS))
    parser.add_argument("--photos-per-class", type=int, default=100)
    parser.add_argument("--k", type=int, default=10, help="rows read per query")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "photo-table-bench")
    parser.add_argument("--smoke", action="store_true", help="2,000 rows, 50 queries")
    parser.add_argument("--one", nargs=2, metavar=("FOLDER", "LOADER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.queries = [2000], 50
    if args.one:
        print(json.dumps(measure(Path(args.one[0]), args.one[1], args.k, args.queries,
                                 args.photos_per_class)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.jsonl"
    results = [json.loads(line) for line in results_path.read_text().splitlines()
               ] if results_path.exists() else []
    done = {(r["n"], r["loader"]) for r in results}
    for n in args.sizes:
        folder = args.out / f"n{n}"
        written = write_both(folder, n, args.photos_per_class)
        print(f"N={n:,}: meta.jsonl {written['meta_bytes'] / 2**20:.0f} MiB written in "
              f"{written['meta_write_s']:.0f} s, table {written['table_bytes'] / 2**20:.0f} MiB "
              f"in {written['table_write_s']:.0f} s", flush=True)
        for loader in args.loaders:
            if (n, loader) in done:
                continue
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.photo_table_bench", "--one", str(folder),
                 loader, "--k", str(args.k), "--queries", str(args.queries),
                 "--photos-per-class", str(args.photos_per_class)],
                cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{loader} at N={n} failed")
            result = {"n": n, "loader": loader, **written,
                      **json.loads(proc.stdout.strip().splitlines()[-1])}
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            results.append(result)
            print(f"  {LABELS[loader]}: load {result['load_s']:.2f} s, RSS "
                  f"+{result['rss_bytes'] / 2**20:.1f} MiB", flush=True)
    text = table(results)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
