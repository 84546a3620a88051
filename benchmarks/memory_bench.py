"""Peak memory of the retrieval service under concurrent maximum-size uploads (127.0.0.1).

    python benchmarks/memory_bench.py --index runs/index [--batches 4 --files 16 --side 4095]

Starts `python -m service` as its own process on a free local port, warms it with one small
request, then reads its peak RSS (VmHWM in /proc/PID/status, exact, not sampled) before and
after (1) one `POST /retrieve/batch` of `--files` legal `--side` x `--side` RGBA PNGs (black
strokes on a transparent background, about 75 KB each) and (2) `--batches` such requests at
once. (1) is the memory of one admitted request; (2) the growth under a burst. Without
--index it builds a small one from an untrained checkpoint at 224 px (memory does not depend
on training). `--smoke`: small images in a temporary folder, a check that it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.client import AsyncClient, ServiceError  # noqa: E402

MB = 1024 * 1024


def big_sketch_png(side: int = 4095, seed: int = 0) -> bytes:
    """A legal side x side RGBA PNG: a few black strokes on transparency (compresses well)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    img = Image.new("RGBA", (side, side), (0, 0, 0, 0))
    draw = ImageDraw.Draw(img)
    for _ in range(8):
        draw.line([tuple(p) for p in rng.integers(0, side, (6, 2)).tolist()],
                  fill=(0, 0, 0, 255), width=max(3, side // 100))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def peak_rss(pid: int) -> int:
    """Peak resident set size of process `pid` in bytes (VmHWM, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


async def burst(base: str, png: bytes, batches: int, files: int) -> list[int]:
    """`batches` concurrent /retrieve/batch requests of `files` copies of `png`: statuses."""

    async def one(service: AsyncClient) -> int:
        try:
            await service.retrieve_batch([png] * files, k=5)
        except ServiceError as err:
            return err.status
        return 200

    async with AsyncClient(base, timeout=600, connections=batches) as service:
        return list(await asyncio.gather(*(one(service) for _ in range(batches))))


def measure(base: str, pid: int, png: bytes, batches: int, files: int) -> dict:
    """Peak RSS growth (bytes) of one batch alone, then of `batches` at once."""
    small = big_sketch_png(256)
    asyncio.run(burst(base, small, 1, 2))  # warm-up: first forward, allocator pools
    start = peak_rss(pid)
    t0 = time.perf_counter()
    one = asyncio.run(burst(base, png, 1, files))
    t1 = time.perf_counter()
    after_one = peak_rss(pid)
    many = asyncio.run(burst(base, png, batches, files))
    t2 = time.perf_counter()
    return {"start": start, "one": after_one - start, "burst": peak_rss(pid) - start,
            "statuses": one + many, "seconds_one": t1 - t0, "seconds_burst": t2 - t1}


def prepare_index(out: Path, image_size: int = 224) -> Path:
    """A 15-photo index from an untrained model bundle (once)."""
    if (out / "index" / "CURRENT").is_file():
        return out / "index"
    from index.build import build_index
    from tests.bundles import untrained_bundle
    from tests.fakes import make_gallery

    model = untrained_bundle(out, modes=16, hidden=64, image_size=image_size)
    photos = make_gallery(out / "photos", classes=3, per_class=5, size=64)
    build_index(model, photos, out / "index", progress=False)
    return out / "index"


def start_service(index: Path, *flags: str) -> tuple[str, subprocess.Popen]:
    from benchmarks.service_bench import free_port, wait_healthy

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--index", str(index), "--port", str(port),
         "--host", "127.0.0.1", "--log-level", "warning", *flags], cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_healthy(base, proc)
    return base, proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--index", type=Path, default=None)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "membench")
    p.add_argument("--batches", type=int, default=4, help="concurrent batch requests")
    p.add_argument("--files", type=int, default=16, help="images per batch request")
    p.add_argument("--side", type=int, default=4095, help="image width and height")
    p.add_argument("--smoke", action="store_true", help="2 batches of 2 images of 512 px on a "
                   "tiny index in a temporary folder: checks that the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.files, args.side = 2, 2, 512
        args.work = Path(tempfile.mkdtemp(prefix="memory-bench-"))
    try:
        index = args.index or prepare_index(args.work, 64 if args.smoke else 224)
        png = big_sketch_png(args.side)
        base, proc = start_service(index, *(("--encoder", "torch") if args.smoke else ()))
        try:
            res = measure(base, proc.pid, png, args.batches, args.files)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        if args.smoke:
            shutil.rmtree(args.work, ignore_errors=True)
    print(f"{args.files} x {args.side}x{args.side} RGBA PNG per request "
          f"({args.files * len(png) / MB:.2f} MB), baseline peak RSS {res['start'] / MB:.0f} MB")
    print(f"one request: peak RSS +{res['one'] / MB:.0f} MB ({res['seconds_one']:.1f} s)")
    print(f"{args.batches} concurrent: peak RSS +{res['burst'] / MB:.0f} MB "
          f"({res['seconds_burst']:.1f} s); statuses {res['statuses']}")
    return 0 if set(res["statuses"]) == {200} else 1


if __name__ == "__main__":
    raise SystemExit(main())
