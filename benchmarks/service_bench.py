"""Bounded load test of the retrieval service on 127.0.0.1, and the split of a request's time,
for each sketch encoder (PyTorch and ONNX Runtime) in the same run.

    python benchmarks/service_bench.py                       # builds runs/bench/index once
    python benchmarks/service_bench.py --index runs/index    # an existing index
    python benchmarks/service_bench.py --encoders onnx       # one encoder only
    python benchmarks/service_bench.py --encoders onnx --flip-average false true  # mirror cost
    python benchmarks/service_bench.py --encoders onnx --layouts 1x2 2x1  # threads x slots

For each encoder, starts `python -m service` as a separate process on a free local port,
sends a fixed number of `POST /retrieve` requests at each concurrency (1, 4, 16), and prints
p50/p99 latency, throughput and the error count (which must be zero). The split of one
request into decode, preprocess, encode (backbone + head) and search comes from the server's
`Server-Timing` header; the rest of the client-side latency is HTTP, multipart parsing and
JSON. The load client runs on the same machine and takes its share of the CPU.

Without --index it builds one from an untrained checkpoint shaped like the `cpu` preset
(EfficientNet-Lite1 at 240 px, head 1024 -> L=256; timing does not depend on training) over
the sketchy-mini photos.
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
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "sketchy-mini"
STAGES = ("decode", "preprocess", "encode", "search")
ENCODERS = ("torch", "onnx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_index(out: Path, data: Path, classes: int | None, flip_average: bool = True
                  ) -> Path:
    """An index over sketchy-mini photos from a cpu-preset-shaped untrained checkpoint."""
    if (out / "index" / "CURRENT").is_file():
        return out / "index"
    sys.path.insert(0, str(REPO))
    import torch

    from index.build import build_index
    from training.cdk.model.checkpoint import init_checkpoint
    from training.cdk.model.embedder import Embedder

    torch.set_num_threads(2)
    photos = data / "photo"
    if classes is not None:  # a smaller gallery: copies (the index refuses outside links)
        photos = out / "photos"
        for cls in sorted(p.name for p in (data / "photo").iterdir())[:classes]:
            (photos / cls).mkdir(parents=True, exist_ok=True)
            for f in (data / "photo" / cls).iterdir():
                copy = photos / cls / f.name
                if not copy.exists():
                    shutil.copyfile(f, copy)
    ckpt = init_checkpoint(out / "checkpoint.pt", backbone="efficientnet-lite1", L=256,
                           hidden=1024, image_size=240, flip_average=flip_average)
    build_index(Embedder.from_checkpoint(ckpt, device="cpu"), photos, out / "index", ckpt)
    return out / "index"


def sketches(data: Path, n: int = 32) -> list[bytes]:
    files = sorted((data / "sketch").glob("*/*.png"))
    step = max(1, len(files) // n)
    return [f.read_bytes() for f in files[::step][:n]]


def parse_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


async def load(base: str, bodies: list[bytes], concurrency: int, requests: int, dims: int,
               k: int, batch: int = 0) -> dict:
    """`requests` POSTs with `concurrency` in flight; latencies in ms.

    batch=0 posts one sketch to /retrieve; batch=B posts B sketches to /retrieve/batch.
    """
    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    errors: list[str] = []
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for i in counter:
                params = {"dims": dims, "k": k}
                t0 = time.perf_counter()
                try:
                    if batch:
                        files = [("files", (f"q{j}.png", bodies[(i * batch + j) % len(bodies)],
                                            "image/png")) for j in range(batch)]
                        r = await client.post("/retrieve/batch", params=params, files=files)
                        ok = r.status_code == 200 and [len(q["results"]) for q in
                                                       r.json()["queries"]] == [k] * batch
                    else:
                        body = bodies[i % len(bodies)]
                        r = await client.post("/retrieve", params=params,
                                              files={"file": ("q.png", body, "image/png")})
                        ok = r.status_code == 200 and len(r.json()["results"]) == k
                except httpx.HTTPError as err:
                    errors.append(repr(err))
                    continue
                latencies.append(1000 * (time.perf_counter() - t0))
                if ok:
                    timings.append(parse_timing(r.headers["server-timing"]))
                else:
                    errors.append(f"{r.status_code} {r.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "timings": timings, "errors": errors, "wall": wall}


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 180) -> None:
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


def run_server(index: Path, encoder: str, args, bodies: list[bytes]) -> dict:
    """Start the service with `encoder`, load it at each concurrency; the rows it prints."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "SKETCHSVD_THREADS": str(args.threads), "SKETCHSVD_INFERENCE_SLOTS": str(args.slots),
           "SKETCHSVD_MAX_K": str(max(100, args.k)), "SKETCHSVD_ENCODER": encoder}
    server = subprocess.Popen(
        [sys.executable, "-m", "service", "--index", str(index), "--port", str(port),
         "--log-level", "warning"], cwd=REPO, env=env)
    rows: dict = {"errors": 0, "load": {}}
    try:
        wait_healthy(base, server)
        info = httpx.get(base + "/info").json()
        dims = args.dims or info["available_dims"]["max"]
        print(f"\n[{info['encoder']}] index {index}: {info['gallery_size']} photos, "
              f"{info['backbone']}, width={info['width']}, dims={dims}, k={args.k}, "
              f"{os.cpu_count()} CPUs, server threads={args.threads} slots={args.slots}")
        asyncio.run(load(base, bodies, 2, 8, dims, args.k))  # warm-up
        print(f"{'conc':>4} {'reqs':>5} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} {'errors':>6}")
        for c in args.concurrency:
            res = asyncio.run(load(base, bodies, c, args.requests, dims, args.k))
            lat = np.array(res["latencies"])
            row = (np.percentile(lat, 50), np.percentile(lat, 99), args.requests / res["wall"])
            rows["load"][c] = row
            rows["errors"] += len(res["errors"])
            print(f"{c:>4} {args.requests:>5} {row[0]:>8.1f} {row[1]:>8.1f} {row[2]:>7.1f} "
                  f"{len(res['errors']):>6}")
            for e in res["errors"][:3]:
                print(f"     error: {e}")
        # One request at a time: where its time goes.
        single = asyncio.run(load(base, bodies, 1, 32, dims, args.k))
        split = {s: statistics.median(t[s] for t in single["timings"]) for s in STAGES}
        total = statistics.median(single["latencies"])
        print("split of one request (median of 32, ms): " + ", ".join(
            f"{s} {split[s]:.2f}" for s in STAGES)
            + f", http+multipart+json {total - sum(split.values()):.2f}, total {total:.2f}")
        if args.batch:
            n = max(1, args.requests // args.batch)
            res = asyncio.run(load(base, bodies, 1, n, dims, args.k, batch=args.batch))
            rows["errors"] += len(res["errors"])
            print(f"batch form, {args.batch} sketches per request, concurrency 1: "
                  f"{n * args.batch / res['wall']:.1f} sketches/s, p50 "
                  f"{np.percentile(res['latencies'], 50):.1f} ms per request, "
                  f"{len(res['errors'])} errors")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--index", type=Path, default=None)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench")
    p.add_argument("--classes", type=int, default=None, help="gallery classes (default all)")
    p.add_argument("--encoders", nargs="+", choices=ENCODERS, default=list(ENCODERS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--dims", type=int, default=None, help="default: all stored dims")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="server threads per forward")
    p.add_argument("--slots", type=int, default=2, help="server concurrent forwards")
    p.add_argument("--batch", type=int, default=8, help="sketches per /retrieve/batch request")
    p.add_argument("--flip-average", nargs="+", choices=("true", "false"), default=["true"],
                   help="built index only: the checkpoint averages features over the mirror "
                        "image (the cpu preset) or not; both: compared in one run")
    p.add_argument("--layouts", nargs="+", default=None, metavar="THREADSxSLOTS",
                   help="server layouts compared in one run, e.g. 1x2 2x1 (threads per "
                        "forward x concurrent forwards); default: --threads x --slots")
    args = p.parse_args(argv)
    layouts = [(args.threads, args.slots)]
    if args.layouts:
        try:
            layouts = [tuple(int(v) for v in lay.lower().split("x")) for lay in args.layouts]
        except ValueError:
            p.error(f"--layouts takes THREADSxSLOTS values such as 2x1, got {args.layouts}")
        if any(len(lay) != 2 or min(lay) < 1 for lay in layouts):
            p.error(f"--layouts takes THREADSxSLOTS values such as 2x1, got {args.layouts}")

    bodies = sketches(args.data)
    results = {}
    for mirror in args.flip_average:
        flip = mirror == "true"
        # the built checkpoint's features: each image's, or averaged with its mirror image's
        # (training's --flip-average; two backbone passes a sketch)
        index = args.index or prepare_index(args.work / f"mirror-{mirror}", args.data,
                                            args.classes, flip)
        for enc in args.encoders:
            for threads, slots in layouts:
                args.threads, args.slots = threads, slots
                name = (f"{enc}" + ("" if args.index else f", mirror {mirror}")
                        + (f", {threads}x{slots}" if len(layouts) > 1 else ""))
                results[name] = run_server(index, enc, args, bodies)
        if args.index:
            break
    (a, ra), *others = results.items()
    for b, rb in others:
        print(f"\n{b} vs {a}, same run:")
        for c in args.concurrency:
            (pa50, pa99, qa), (pb50, pb99, qb) = ra["load"][c], rb["load"][c]
            print(f"  concurrency {c:>2}: req/s x{qb / qa:.2f}, p50 {pa50:.1f} -> {pb50:.1f} ms, "
                  f"p99 {pa99:.1f} -> {pb99:.1f} ms")
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
