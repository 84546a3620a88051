"""Bounded load test of the retrieval service on 127.0.0.1, and the split of a request's time,
for each sketch encoder and precision in the same run.

    python benchmarks/service_bench.py --index runs/index --encoders onnx --precisions fp32 int8
    python benchmarks/service_bench.py --data DIR            # builds runs/bench/index once
    python benchmarks/service_bench.py --data DIR --encoders onnx --flip-average false true
    python benchmarks/service_bench.py --data DIR --encoders onnx --layouts 1x2 2x1
    python benchmarks/service_bench.py --index runs/index runs/index-fast --encoders onnx
    python benchmarks/service_bench.py --smoke               # tiny data, seconds: a check

For each configuration, starts `python -m service` as a separate process on a free local
port, sends a fixed number of `POST /retrieve` requests (service.client) at each concurrency
(1, 4, 16), and prints p50/p99 latency, throughput and the error count (which must be zero),
then whether the targets hold (c=16: >= 250 req/s with p99 <= 150 ms; c=1: p50 <= 8 ms).
The split of one request into decode, preprocess, encode (backbone + head) and search comes
from the server's `Server-Timing` header; the rest of the client-side latency is HTTP,
multipart parsing and JSON. The load client runs on the same machine and takes its share of
the CPU. The int8 graph is the model bundle's (calibrated when the bundle was written; a
bundle written without its training data has none).

Without --index it builds one from an untrained model bundle shaped like the `cpu` preset
(EfficientNet-Lite1 at 240 px, head 1024 -> 256 modes + 256 raw coordinates; timing does not
depend on training) over the photos of --data DIR (a sketch/photo folder such as
sketchy-mini; default $SKETCHY_DATA), whose sketches are then the queries (else generated
strokes). The third line compares mirror averaging on and off, the fourth two layouts of
server threads x concurrent forwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.client import AsyncClient, ServiceError  # noqa: E402

DATA = os.environ.get("SKETCHY_DATA")  # the sketch/photo folder when --data is not given
STAGES = ("decode", "preprocess", "encode", "search")
ENCODERS = ("torch", "onnx")
TARGETS = {"c16_rps": 250.0, "c16_p99_ms": 150.0, "c1_p50_ms": 8.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_classes(data: Path, out: Path, classes: int) -> Path:
    """The photos of the first `classes` classes, copied (the index refuses outside links)."""
    for cls in sorted(p.name for p in (data / "photo").iterdir())[:classes]:
        (out / cls).mkdir(parents=True, exist_ok=True)
        for f in (data / "photo" / cls).iterdir():
            if not (out / cls / f.name).exists():
                shutil.copyfile(f, out / cls / f.name)
    return out


def prepare_index(out: Path, data: Path, classes: int | None, flip_average: bool = True,
                  smoke: bool = False) -> Path:
    """An index over sketchy-mini photos from a cpu-preset-shaped untrained model bundle
    (written with sketchy-mini as its data, so it holds int8 graphs; smoke: a tiny bundle
    over generated photos)."""
    if (out / "index" / "CURRENT").is_file():
        return out / "index"
    import torch

    from index.build import build_index
    from tests.bundles import untrained_bundle

    torch.set_num_threads(2)
    if smoke:
        from tests.fakes import make_gallery

        photos = make_gallery(out / "photos", classes=3, per_class=4, size=64)
        model = untrained_bundle(out, modes=8, hidden=16, image_size=64, raw_dims=0)
    else:
        photos = (data / "photo" if classes is None
                  else copy_classes(data, out / "photos", classes))
        model = untrained_bundle(out, data=data, backbone="efficientnet-lite1", modes=256,
                                 hidden=1024, image_size=240, photo_flip_average=flip_average)
    build_index(model, photos, out / "index", progress=not smoke)
    return out / "index"


def sketches(data: Path | None, n: int = 32) -> list[bytes]:
    """Real sketches when the data is given, else generated strokes."""
    files = [] if data is None else sorted((data / "sketch").glob("*/*.png"))
    if not files:
        from tests.service.conftest import sketch_png

        return [sketch_png(seed=s) for s in range(n)]
    step = max(1, len(files) // n)
    return [f.read_bytes() for f in files[::step][:n]]


async def load(base: str, bodies: list[bytes], concurrency: int, requests: int, dims: int,
               k: int, batch: int = 0) -> dict:
    """`requests` POSTs with `concurrency` in flight; latencies in ms.

    batch=0 posts one sketch to /retrieve; batch=B posts B sketches to /retrieve/batch.
    """
    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    errors: list[str] = []
    counter = iter(range(requests))

    async with AsyncClient(base, timeout=120, connections=concurrency) as service:

        async def worker() -> None:
            for i in counter:
                t0 = time.perf_counter()
                try:
                    if batch:
                        sent = [bodies[(i * batch + j) % len(bodies)] for j in range(batch)]
                        results = await service.retrieve_batch(sent, dims=dims, k=k)
                    else:
                        results = [await service.retrieve(bodies[i % len(bodies)], dims=dims,
                                                          k=k)]
                except (ServiceError, httpx.HTTPError) as err:
                    errors.append(repr(err)[:200])
                    continue
                latencies.append(1000 * (time.perf_counter() - t0))
                if [len(r.hits) for r in results] == [k] * len(results):
                    timings.append(results[0].timings)
                else:
                    errors.append(f"short results: {[len(r.hits) for r in results]}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "timings": timings, "errors": errors, "wall": wall}


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    """Until /health answers 200 (the first int8 start quantizes: minutes on a busy CPU)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"service not healthy after {timeout:.0f}s")


def start_server(index: Path, config: dict, args) -> tuple[str, subprocess.Popen]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"]),
           "SKETCHSVD_THREADS": str(config["threads"]),
           "SKETCHSVD_INFERENCE_SLOTS": str(config["slots"]),
           "SKETCHSVD_MAX_K": str(max(100, args.k)), "SKETCHSVD_ENCODER": config["encoder"],
           "SKETCHSVD_PRECISION": config["precision"]}
    server = subprocess.Popen(
        [sys.executable, "-m", "service", "--index", str(index), "--port", str(port),
         "--log-level", "warning"], cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server)
    except BaseException:
        server.terminate()
        server.wait(timeout=30)
        raise
    return base, server


def run_server(index: Path, config: dict, args, bodies: list[bytes]) -> dict:
    """Start the service with `config`, load it at each concurrency; the rows it prints."""
    base, server = start_server(index, config, args)
    rows: dict = {"errors": 0, "load": {}}
    try:
        info = httpx.get(base + "/info").json()
        dims = args.dims or info["available_dims"]["max"]
        print(f"\n[{info['encoder']} {info['precision']}] index {index}: "
              f"{info['gallery_size']} photos, {info['backbone']}, width={info['width']}, "
              f"dims={dims}, k={args.k}, {os.cpu_count()} CPUs, server threads="
              f"{config['threads']} slots={config['slots']}")
        asyncio.run(load(base, bodies, 2, 8, dims, args.k))  # warm-up
        print(f"{'conc':>4} {'reqs':>5} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} {'errors':>6}")
        for c in args.concurrency:
            res = asyncio.run(load(base, bodies, c, args.requests, dims, args.k))
            lat = np.array(res["latencies"] or [np.nan])
            row = (np.percentile(lat, 50), np.percentile(lat, 99), args.requests / res["wall"])
            rows["load"][c] = row
            rows["errors"] += len(res["errors"])
            print(f"{c:>4} {args.requests:>5} {row[0]:>8.1f} {row[1]:>8.1f} {row[2]:>7.1f} "
                  f"{len(res['errors']):>6}")
            for e in res["errors"][:3]:
                print(f"     error: {e}")
        rows["split"] = split_of_one(base, bodies, dims, args)
        if args.batch:
            rows["errors"] += batch_form(base, bodies, dims, args)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return rows


def split_of_one(base: str, bodies: list[bytes], dims: int, args) -> dict:
    """One request at a time: where its time goes (medians, ms)."""
    single = asyncio.run(load(base, bodies, 1, args.split_requests, dims, args.k))
    split = {s: statistics.median(t[s] for t in single["timings"]) for s in STAGES}
    total = statistics.median(single["latencies"])
    print(f"split of one request (median of {args.split_requests}, ms): " + ", ".join(
        f"{s} {split[s]:.2f}" for s in STAGES)
        + f", http+multipart+json {total - sum(split.values()):.2f}, total {total:.2f}")
    return split


def batch_form(base: str, bodies: list[bytes], dims: int, args) -> int:
    n = max(1, args.requests // args.batch)
    res = asyncio.run(load(base, bodies, 1, n, dims, args.k, batch=args.batch))
    print(f"batch form, {args.batch} sketches per request, concurrency 1: "
          f"{n * args.batch / res['wall']:.1f} sketches/s, p50 "
          f"{np.percentile(res['latencies'] or [np.nan], 50):.1f} ms per request, "
          f"{len(res['errors'])} errors")
    return len(res["errors"])


def report(results: dict, concurrency: list[int]) -> None:
    """Ratios against the first configuration, and the targets."""
    (a, ra), *others = results.items()
    for b, rb in others:
        print(f"\n{b} vs {a}, same run:")
        for c in concurrency:
            (pa50, pa99, qa), (pb50, pb99, qb) = ra["load"][c], rb["load"][c]
            print(f"  concurrency {c:>2}: req/s x{qb / qa:.2f}, p50 {pa50:.1f} -> {pb50:.1f} ms, "
                  f"p99 {pa99:.1f} -> {pb99:.1f} ms")
    if 1 in concurrency and 16 in concurrency:
        print(f"\ntargets: c=16 >= {TARGETS['c16_rps']:.0f} req/s with p99 <= "
              f"{TARGETS['c16_p99_ms']:.0f} ms, c=1 p50 <= {TARGETS['c1_p50_ms']:.0f} ms")
        for name, r in results.items():
            (p50, _, _), (_, p99, rps) = r["load"][1], r["load"][16]
            met = (rps >= TARGETS["c16_rps"] and p99 <= TARGETS["c16_p99_ms"]
                   and p50 <= TARGETS["c1_p50_ms"] and not r["errors"])
            print(f"  {name}: {rps:.1f} req/s, p99 {p99:.1f} ms, c=1 p50 {p50:.1f} ms, "
                  f"{r['errors']} errors: {'met' if met else 'not met'}")


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--index", type=Path, nargs="+", default=None,
                   help="index folders (each with its model bundle), measured in one run; "
                        "default: one built from an untrained model bundle")
    p.add_argument("--data", type=Path, default=DATA, metavar="DIR",
                   help="the sketch/photo folder: the query sketches (else generated strokes) "
                        "and, without --index, the photos indexed (default: $SKETCHY_DATA)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench")
    p.add_argument("--classes", type=int, default=None, help="gallery classes (default all)")
    p.add_argument("--encoders", nargs="+", choices=ENCODERS, default=list(ENCODERS))
    p.add_argument("--precisions", nargs="+", choices=("fp32", "int8", "auto"),
                   default=["fp32"], help="the ONNX encoder's precisions compared")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--split-requests", type=int, default=32)
    p.add_argument("--dims", type=int, default=None, help="default: all stored dims")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="server threads per forward")
    p.add_argument("--slots", type=int, default=2, help="server concurrent forwards")
    p.add_argument("--batch", type=int, default=8, help="sketches per /retrieve/batch request")
    p.add_argument("--flip-average", nargs="+", choices=("true", "false"), default=["true"],
                   help="built index only: the model averages features over the mirror "
                        "image or not; both: compared in one run")
    p.add_argument("--layouts", nargs="+", default=None, metavar="THREADSxSLOTS",
                   help="server layouts compared in one run, e.g. 1x2 2x1 (threads per "
                        "forward x concurrent forwards); default: --threads x --slots")
    p.add_argument("--smoke", action="store_true", help="a tiny index and a few requests in "
                   "a temporary folder: checks that the benchmark runs")
    args = p.parse_args(argv)
    layouts = [(args.threads, args.slots)]
    if args.layouts:
        try:
            layouts = [tuple(int(v) for v in lay.lower().split("x")) for lay in args.layouts]
        except ValueError:
            p.error(f"--layouts takes THREADSxSLOTS values such as 2x1, got {args.layouts}")
        if any(len(lay) != 2 or min(lay) < 1 for lay in layouts):
            p.error(f"--layouts takes THREADSxSLOTS values such as 2x1, got {args.layouts}")
    if args.index is None and args.data is None and not args.smoke:
        p.error("without --index the benchmark indexes the photos of --data DIR (or "
                "SKETCHY_DATA=DIR)")
    if args.smoke:
        args.encoders, args.precisions, args.concurrency = ["onnx"], ["fp32"], [1, 2]
        args.requests, args.split_requests, args.batch, args.k = 6, 4, 2, 3
    return args, layouts


def configurations(args, layouts) -> list[dict]:
    out = []
    for enc in args.encoders:
        for precision in (args.precisions if enc == "onnx" else ["fp32"]):
            for threads, slots in layouts:
                out.append({"encoder": enc, "precision": precision, "threads": threads,
                            "slots": slots})
    return out


def main(argv: list[str] | None = None) -> int:
    args, layouts = parse_args(argv)
    bodies = sketches(None if args.smoke else args.data)
    work = Path(tempfile.mkdtemp(prefix="service-bench-")) if args.smoke else args.work
    results = {}
    try:
        for mirror in args.flip_average:
            indexes = args.index or [prepare_index(work / f"mirror-{mirror}", args.data,
                                                   args.classes, mirror == "true", args.smoke)]
            for index in indexes:
                for config in configurations(args, layouts):
                    name = (f"{config['encoder']} {config['precision']}"
                            + (f", {index.name}" if args.index and len(indexes) > 1 else "")
                            + ("" if args.index else f", mirror {mirror}")
                            + (f", {config['threads']}x{config['slots']}" if len(layouts) > 1
                               else ""))
                    results[name] = run_server(index, config, args, bodies)
            if args.index:
                break
        report(results, args.concurrency)
    finally:
        if args.smoke:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
