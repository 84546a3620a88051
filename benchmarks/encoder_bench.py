"""Sketch encoder (backbone + head) on the CPU: PyTorch vs ONNX Runtime vs OpenVINO, same run.

    python benchmarks/encoder_bench.py [--checkpoint CKPT] [--threads 1 2] [--batches 1 4 16]

Prints milliseconds per image (best of `--repeats` timed calls after a warm-up) for each
runtime, thread count and batch size, and each runtime's largest difference from PyTorch's
embedding relative to the embedding's scale. This is how the service's CPU path was chosen
(training/cdk/model/export.py): ONNX Runtime in float32. OpenVINO is measured when it is installed
(`pip install openvino`; not a dependency), in float32 and in its default precision, which
is bf16 on CPUs with AVX512-BF16 or AMX. Per-image time by batch size also says whether
forming micro-batches of concurrent requests would pay.

Without --checkpoint it uses an untrained checkpoint shaped like the `cpu` preset
(EfficientNet-Lite1 at 240 px, head 1024 -> L=256): timing does not depend on training.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.allocator import tune_allocator  # noqa: E402
from training.cdk.model.checkpoint import init_checkpoint  # noqa: E402
from training.cdk.model.embedder import Embedder  # noqa: E402
from training.cdk.model.export import OnnxEncoder, export_encoder  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def runtimes(embedder: Embedder, model: bytes, threads: int) -> dict:
    """name -> callable (N, 3, S, S) float32 array -> (N, L)."""
    torch.set_num_threads(threads)
    out = {"torch": lambda x: embedder.encode(torch.from_numpy(x), "sketch").numpy()}
    out["onnxruntime"] = OnnxEncoder(model, embedder.checkpoint_sha256, threads=threads)
    try:
        import openvino as ov
    except ImportError:
        print("openvino is not installed: not measured")
        return out
    core = ov.Core()
    for name, precision in (("openvino-f32", "f32"), ("openvino-default", None)):
        cfg = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        if precision:
            cfg["INFERENCE_PRECISION_HINT"] = precision
        compiled = core.compile_model(core.read_model(model, b""), "CPU", cfg)
        out[name] = lambda x, c=compiled: c(x)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    tune_allocator()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    ckpt = args.checkpoint or init_checkpoint(REPO / "runs" / "bench" / "encoder-ckpt.pt",
                                              backbone="efficientnet-lite1", modes=256,
                                              hidden=1024, image_size=240)
    embedder = Embedder.from_checkpoint(ckpt, device="cpu")
    t0 = time.perf_counter()
    model = export_encoder(embedder)
    print(f"{embedder.backbone} at {embedder.image_size} px, width {embedder.width}; export "
          f"{time.perf_counter() - t0:.1f} s, {len(model) / 1e6:.1f} MB")
    size = embedder.image_size
    print(f"{'threads':>7} {'batch':>5} {'runtime':>17} {'ms/image':>9} {'vs torch':>8} "
          f"{'max |diff|/scale':>16}")
    with torch.inference_mode():
        for threads in args.threads:
            encoders = runtimes(embedder, model, threads)
            for n in args.batches:
                x = np.random.default_rng(n).standard_normal((n, 3, size, size), np.float32)
                ref = encoders["torch"](x)
                scale = float(np.abs(ref).max())
                base = None
                for name, enc in encoders.items():
                    ms = best_ms(lambda e=enc, x=x: e(x), args.repeats) / n
                    base = base or ms
                    err = float(np.abs(enc(x) - ref).max()) / scale
                    print(f"{threads:>7} {n:>5} {name:>17} {ms:>9.2f} {base / ms:>7.2f}x "
                          f"{err:>16.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
