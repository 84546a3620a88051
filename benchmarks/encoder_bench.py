"""Sketch encoder (backbone + head) on the CPU: PyTorch, ONNX Runtime float32 and int8, and
OpenVINO float32 and int8 (NNCF) when installed, same run.

    python benchmarks/encoder_bench.py [--checkpoint CKPT] [--threads 1 2] [--batches 1 4 16]
    python benchmarks/encoder_bench.py --smoke     # a tiny checkpoint, seconds: a check

Prints milliseconds per image (best of `--repeats` timed calls after a warm-up) for each
runtime, thread count and batch size, and each runtime's largest difference from PyTorch's
embedding relative to the embedding's scale. `--parity-all` applies the service's parity rule
to every runtime (OpenVINO bf16 too, on CPUs with it). This is how the service's CPU path was chosen
(training/cdk/model/export.py): ONNX Runtime, in int8 where it holds parity
(training/cdk/quantize.py) and is faster. Both int8 graphs are calibrated on the same
images: training-class sketches of the checkpoint's data when it is at hand (`--data`
overrides its folder), else random images (speed only). The ONNX Runtime int8 graph keeps
its first `--float-front` convolutions in float32 (default: the service's first try).
OpenVINO is measured when `openvino` (and `nncf` for int8) are installed; they are not
dependencies.

Without --checkpoint it uses an untrained checkpoint shaped like the `cpu` preset
(EfficientNet-Lite1 at 240 px, head 1024 -> 256 modes + 256 raw): timing does not depend on
training.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.bundles import init_checkpoint  # noqa: E402
from training.allocator import tune_allocator  # noqa: E402
from training.cdk.make_bundle import embedder_of_checkpoint  # noqa: E402
from training.cdk.model.embedder import Embedder  # noqa: E402
from training.cdk.model.export import INPUT, OnnxEncoder, export_encoder  # noqa: E402
from training.cdk.quantize import (  # noqa: E402
    FLOAT_FRONT,
    ParityCheck,
    QuantizationError,
    calibration_files,
    calibration_sets,
    images_of,
    preprocessed,
    quantize_graph,
)


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def calibration(embedder: Embedder, cfg, data: Path | None, n: int):
    """(1, 3, S, S) batches: training-class sketches, else random images; and the
    validation classes (None without the data)."""
    try:
        train, valid = calibration_sets(data or cfg.data, cfg.split)
        files = calibration_files(train, "sketch", n)
        return [b[i : i + 1] for b in preprocessed(embedder.preprocess, files, "sketch")
                for i in range(len(b))], valid
    except QuantizationError as err:
        print(f"calibrating on random images (speed only, no parity): {err}")
        rng = np.random.default_rng(0)
        size = embedder.size_of("sketch")
        return [rng.standard_normal((1, 3, size, size), np.float32) for _ in range(n)], None


def openvino_runtimes(model: bytes, threads: int, batches: list[np.ndarray]) -> dict:
    try:
        import openvino as ov
    except ImportError:
        print("openvino is not installed: not measured")
        return {}
    core = ov.Core()
    fp32 = core.read_model(model, b"")
    cfg = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
           "INFERENCE_PRECISION_HINT": "f32"}  # else bf16 on CPUs that have it
    out = {"openvino-f32": core.compile_model(fp32, "CPU", cfg)}
    if "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        out["openvino-bf16"] = core.compile_model(fp32, "CPU", {
            **cfg, "INFERENCE_PRECISION_HINT": "bf16"})
    try:
        import nncf
    except ImportError:
        print("nncf is not installed: OpenVINO int8 not measured")
    else:
        q = nncf.quantize(fp32, nncf.Dataset(batches), subset_size=len(batches),
                          preset=nncf.QuantizationPreset.MIXED)
        out["openvino-int8"] = core.compile_model(q, "CPU", cfg)
    return {name: (lambda x, c=c: c(x)[0]) for name, c in out.items()}


def runtimes(embedder: Embedder, model: bytes, int8: bytes, threads: int,
             batches: list[np.ndarray]) -> dict:
    """name -> callable (N, 3, S, S) float32 array -> (N, width)."""
    torch.set_num_threads(threads)
    out = {"torch": lambda x: embedder.encode(torch.from_numpy(x), "sketch").numpy(),
           "onnxruntime": OnnxEncoder(model, threads=threads),
           "onnxruntime-int8": OnnxEncoder(int8, threads=threads, precision="int8")}
    return {**out, **openvino_runtimes(model, threads, batches)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--data", type=Path, default=None, help="the checkpoint's training data "
                   "(default: the folder its config names)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calibration", type=int, default=128, help="calibration images")
    p.add_argument("--float-front", type=int, default=FLOAT_FRONT["sketch"][0],
                   help="leading convolutions of the ONNX Runtime int8 graph kept in float32 "
                   "(default: the service's first try)")
    p.add_argument("--parity-all", action="store_true", help="the parity of every runtime "
                   "(with the data), its embeddings' median error relative to float32's, and "
                   "the top-10 overlap of float32 embeddings with random noise of 1%% and 3%%")
    p.add_argument("--smoke", action="store_true", help="a tiny checkpoint, one thread, "
                   "small batches: checks that the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.threads, args.batches, args.repeats, args.calibration = [1], [1, 2], 2, 4
    return args


def main(argv: list[str] | None = None) -> int:
    tune_allocator()
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="encoder-bench-") as tmp:
        if args.smoke:
            ckpt = init_checkpoint(Path(tmp) / "ckpt.pt", modes=8, hidden=16, image_size=64,
                                   raw_dims=0)
        else:
            ckpt = args.checkpoint or init_checkpoint(
                REPO / "runs" / "bench" / "encoder-ckpt.pt", backbone="efficientnet-lite1",
                modes=256, hidden=1024, image_size=240)
        embedder, cfg, _ = embedder_of_checkpoint(ckpt, device="cpu")
        t0 = time.perf_counter()
        model = export_encoder(embedder)
        t1 = time.perf_counter()
        batches, valid = calibration(embedder, cfg, args.data, args.calibration)
        int8 = _as_int8(quantize_graph(model, iter(batches), INPUT, args.float_front))
        print(f"{embedder.backbone} at {embedder.size_of('sketch')} px, width {embedder.width}; "
              f"export {t1 - t0:.1f} s, {len(model) / 1e6:.1f} MB; int8 "
              f"{time.perf_counter() - t1:.1f} s, {len(int8) / 1e6:.1f} MB")
        if valid is not None:  # the rule bundles are written by (training.cdk.quantize)
            fp32 = OnnxEncoder(model)
            ours = np.concatenate([fp32(b) for b in preprocessed(
                embedder.preprocess, valid.sketches, "sketch")])
            theirs = np.concatenate([embedder.embed(im, "photo")
                                     for im in images_of(valid.photos)])
            check = ParityCheck("sketch", valid.sketches, ours, theirs, valid.sketch_labels,
                                valid.photo_labels, embedder.preprocess)  # float32's side
            parity = check(OnnxEncoder(int8, precision="int8"))
            print(f"int8 parity: {parity}: {'holds' if parity.holds() else 'fails'}")
            if args.parity_all:
                parity_of_all(embedder, valid, fp32, check, model, int8, batches)
        measure(embedder, model, int8, args, batches)
    return 0


def parity_of_all(embedder: Embedder, valid, fp32: OnnxEncoder, check: ParityCheck,
                  model: bytes, int8: bytes, batches) -> None:
    """The service's parity rule (`check`, against ONNX Runtime float32 `fp32`) applied to
    every runtime, with the median relative error of its sketch embeddings; then float32
    with random noise of a known relative size, to show how much error the top-10 overlap
    tolerates."""
    x = np.concatenate(list(preprocessed(embedder.preprocess, valid.sketches[:64], "sketch")))
    ref = fp32(x)
    rng = np.random.default_rng(0)
    noisy = {f"float32 + {r:.0%} noise": _noisy(fp32, r, rng) for r in (0.01, 0.03)}
    for name, enc in {**runtimes(embedder, model, int8, 1, batches), **noisy}.items():
        if name in ("torch", "onnxruntime"):
            continue
        err = np.linalg.norm(enc(x) - ref, axis=1) / np.linalg.norm(ref, axis=1)
        parity = check(enc)
        print(f"{name}: {parity}, median embedding error {np.median(err):.3f}: "
              f"{'holds' if parity.holds() else 'fails'}")


def _noisy(encode, r: float, rng):
    def noisy(x):
        e = encode(x)
        n = rng.standard_normal(e.shape).astype(e.dtype)
        return e + r * n * np.linalg.norm(e, axis=1, keepdims=True) / np.linalg.norm(
            n, axis=1, keepdims=True)
    return noisy


def _as_int8(graph: bytes) -> bytes:
    import onnx

    proto = onnx.load_from_string(graph)
    for prop in proto.metadata_props:
        if prop.key == "precision":
            prop.value = "int8"
    return proto.SerializeToString()


def measure(embedder: Embedder, model: bytes, int8: bytes, args, batches) -> None:
    size = embedder.size_of("sketch")
    print(f"{'threads':>7} {'batch':>5} {'runtime':>17} {'ms/image':>9} {'vs torch':>8} "
          f"{'max |diff|/scale':>16}")
    with torch.inference_mode():
        for threads in args.threads:
            encoders = runtimes(embedder, model, int8, threads, batches)
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


if __name__ == "__main__":
    raise SystemExit(main())
