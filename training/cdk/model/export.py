"""An encoder (backbone + head) as one ONNX graph, run on the CPU by ONNX Runtime, in float32
or int8.

A query's cost on the CPU is its backbone forward. PyTorch's eager CPU kernels for the
EfficientNet-Lite blocks are 2-4x slower than ONNX Runtime's fused ones on the same thread
count (benchmarks/encoder_bench.py), so the service embeds queries on the CPU with this
graph, exported once from the checkpoint with `torch.onnx.export` (torch.export based), and
cached beside the index:

    <index>/encoders/<modality>-<first 16 hex of the checkpoint sha256>[-single-view][-int8].onnx

The file's metadata records its format, the full checkpoint hash, the modality, the width,
whether it averages over the mirror image, whether it scales embeddings to unit length and
its precision; loading it for another checkpoint (or mirror setting) is an
EncoderMismatchError naming both values, and a file of another format is exported again.
A mirror-averaging checkpoint's sketches embedded alone have their own graph (single-view).

Float32 embeddings agree with PyTorch's to ~1e-6. The int8 graph (training.cdk.model.quantize:
calibrated on training-class images, parity measured on validation classes and stored in its
metadata) is served only where its parity holds; `precision="auto"` serves it where it is
also faster than float32 on the CPU at hand (timed when loading), else float32.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from training.files import atomic_write_bytes

from .heads import embedding

__all__ = ["PRECISIONS", "EncoderFormatError", "EncoderMismatchError", "OnnxEncoder",
           "encoder_path", "export_encoder", "load_or_export"]

log = logging.getLogger(__name__)

FORMAT = "sketchsvd-encoder-3"  # bump when the graph's inputs, outputs or meaning change
INPUT, OUTPUT = "images", "embedding"  # (N, 3, S, S) normalised images -> (N, width)
MAX_BATCH = 1024  # the exported batch axis is dynamic up to this
PRECISIONS = ("auto", "fp32", "int8")
FASTER = 0.9  # auto serves int8 when it takes at most this share of float32's time


class EncoderMismatchError(ValueError):
    """An exported encoder that does not belong to the checkpoint being served."""


class EncoderFormatError(EncoderMismatchError):
    """An exported encoder of another format (written by other code): export it again."""


class _Encoder(nn.Module):
    def __init__(self, backbone: nn.Module, head: nn.Module, unit: bool,
                 raw: nn.Module | None):
        super().__init__()
        self.backbone, self.head, self.unit, self.raw = backbone, head, unit, raw

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.backbone(images)
        return embedding(self.head(x), x, self.unit, self.raw)  # (N, width)


def _flip(embedder, modality: str) -> bool:
    """Whether `modality`'s images are averaged with their mirror image as embedded."""
    name = "sketch_flip_average" if modality == "sketch" else "photo_flip_average"
    return bool(getattr(embedder, name, False))


def _single_view(embedder, modality: str) -> bool:
    """A mirror-averaging checkpoint's sketches embedded alone (a graph of their own)."""
    return (modality == "sketch" and bool(embedder.trained_sketch_flip_average)
            and not embedder.sketch_flip_average)


def export_encoder(embedder, modality: str = "sketch") -> bytes:
    """The float32 `modality` encoder of `embedder` (a training.cdk Embedder) as ONNX model
    bytes, with the checkpoint hash, modality, width and image size in its metadata."""
    modules = embedder.modules(modality)  # (backbone, head) on the embedder's device
    unit = embedder.unit_embeddings
    raw = embedder.raw_projection(modality)
    raw = None if raw is None else copy.deepcopy(raw).cpu().float()
    model = _Encoder(*(copy.deepcopy(m).cpu().float() for m in modules), unit, raw).eval()
    size = embedder.size_of(modality)
    example = torch.zeros(2, 3, size, size)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    program = torch.onnx.export(model, (example,), input_names=[INPUT], output_names=[OUTPUT],
                                dynamic_shapes=({0: batch},), dynamo=True, verbose=False)
    program.model.metadata_props.update({
        "format": FORMAT, "checkpoint_sha256": embedder.checkpoint_sha256,
        "modality": modality, "width": str(embedder.width), "image_size": str(size),
        "flip_average": str(_flip(embedder, modality)), "unit_embeddings": str(unit),
        "precision": "fp32",
    })
    return program.model_proto.SerializeToString()


def encoder_path(index: str | Path, checkpoint_sha256: str, modality: str = "sketch",
                 single_view: bool = False, precision: str = "fp32") -> Path:
    """Where the exported encoder of a checkpoint is cached for the index folder `index`
    (`single_view`: the graph of a mirror-averaging checkpoint that embeds images alone)."""
    tail = ("-single-view" if single_view else "") + ("-int8" if precision == "int8" else "")
    return Path(index) / "encoders" / f"{modality}-{checkpoint_sha256[:16]}{tail}.onnx"


class OnnxEncoder:
    """An exported encoder run by ONNX Runtime on the CPU: (N, 3, S, S) float32 images ->
    (N, width) float32 embeddings. `__call__` may be called from several threads at once; each
    call computes on `threads` threads. `precision` is the graph's (fp32 or int8); `meta`
    its metadata."""

    name = "onnxruntime"

    def __init__(self, model: bytes | str | Path, checkpoint_sha256: str,
                 modality: str = "sketch", threads: int = 1, source: str = "encoder",
                 flip_average: bool | None = None, precision: str = "fp32"):
        import onnxruntime as ort  # local: training and the torch path do not need it

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.data = model if isinstance(model, bytes) else Path(model).read_bytes()
        try:
            self.session = ort.InferenceSession(self.data, opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 - ORT raises its own types; name the file
            raise EncoderMismatchError(f"{source} is not a loadable ONNX model: {err}") from err
        self.meta = meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("format") != FORMAT:
            raise EncoderFormatError(
                f"{source} is an encoder graph of format {meta.get('format')!r}; this code "
                f"reads {FORMAT!r}. Delete the file to have it exported again")
        expected = {"checkpoint_sha256": checkpoint_sha256, "modality": modality,
                    "precision": precision}
        if flip_average is not None:
            expected["flip_average"] = str(bool(flip_average))
        wrong = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
        if wrong:
            raise EncoderMismatchError(
                f"{source} does not belong to this checkpoint: it has "
                + ", ".join(f"{k}={v!r}" for k, v in wrong.items()) + "; expected "
                + ", ".join(f"{k}={expected[k]!r}" for k in wrong)
                + ". Delete the file to have it exported again from the checkpoint"
            )
        self.width = int(meta["width"])
        self.image_size = int(meta["image_size"])
        self.precision = precision
        self.source = source

    def __call__(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        x = images.numpy(force=True) if isinstance(images, torch.Tensor) else images
        return self.session.run([OUTPUT], {INPUT: np.ascontiguousarray(x, np.float32)})[0]


def load_or_export(embedder, index: str | Path, threads: int = 1, modality: str = "sketch",
                   precision: str = "fp32", data: str | Path | None = None) -> OnnxEncoder:
    """The cached `modality` encoder of `embedder`'s checkpoint for the index at `index`,
    exported (and for int8 quantized, with `data` or the checkpoint's data for calibration
    and parity) and saved there first when absent. A cached file of another checkpoint is
    refused (EncoderMismatchError).

    precision: fp32; int8 (QuantizationError when it cannot be made or its parity fails);
    auto: int8 where it holds parity and is faster on this CPU, else fp32 (with the reason
    logged). An index folder that cannot be written (a read-only volume) gets its graphs
    made in memory, with a warning: nothing is lost but the start-up time of the next start.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    fp32 = _load_or_make(embedder, index, threads, modality, "fp32",
                         lambda: export_encoder(embedder, modality))
    if precision == "fp32":
        return fp32
    from .quantize import QuantizationError

    try:
        int8 = _load_or_make(embedder, index, threads, modality, "int8",
                             lambda: _quantize(embedder, modality, fp32, data))
        _check_parity(int8, modality)
    except QuantizationError as err:
        if precision == "int8":
            raise
        log.warning("%s encoder in float32: %s", modality, err)
        return fp32
    return int8 if precision == "int8" else _faster(fp32, int8, modality)


def _load_or_make(embedder, index, threads: int, modality: str, precision: str, make
                  ) -> OnnxEncoder:
    """The cached graph of this precision, else `make()`'s bytes, saved when possible."""
    sha = embedder.checkpoint_sha256
    path = encoder_path(index, sha, modality, _single_view(embedder, modality), precision)
    args = dict(checkpoint_sha256=sha, modality=modality, threads=threads,
                flip_average=_flip(embedder, modality), precision=precision)
    if path.is_file():
        log.info("%s encoder (%s) from %s", modality, precision, path)
        try:
            return OnnxEncoder(path, source=str(path), **args)
        except EncoderFormatError as err:
            log.info("making it again: %s", err)
    log.info("making the %s %s encoder (once per checkpoint)", precision, modality)
    data = make()
    try:
        atomic_write_bytes(data, path)
        log.info("saved %s (%.1f MB)", path, len(data) / 1e6)
    except OSError as err:
        log.warning("cannot save the %s encoder at %s (%s): using it from memory; the next "
                    "start makes it again", precision, path, err)
    return OnnxEncoder(data, source=f"exported {modality} encoder ({precision})", **args)


def _check_parity(int8: OnnxEncoder, modality: str) -> None:
    from .quantize import Parity, QuantizationError

    parity = Parity.from_metadata(int8.meta)
    if not parity.holds():
        raise QuantizationError(f"the int8 {modality} encoder ({int8.source}) does not hold "
                                f"parity with float32: {parity}")
    log.info("int8 %s encoder parity: %s", modality, parity)


def _faster(fp32: OnnxEncoder, int8: OnnxEncoder, modality: str, rounds: int = 7
            ) -> OnnxEncoder:
    """int8 if its forward of one image takes at most FASTER x float32's here (medians of
    interleaved runs), else fp32."""
    x = np.random.default_rng(0).standard_normal((1, 3, fp32.image_size, fp32.image_size),
                                                 dtype=np.float32)
    times: dict[str, list[float]] = {"fp32": [], "int8": []}
    for i in range(rounds + 2):
        for name, enc in (("fp32", fp32), ("int8", int8)):
            t0 = time.perf_counter()
            enc(x)
            if i >= 2:  # the first runs allocate
                times[name].append(time.perf_counter() - t0)
    ms = {name: 1000 * float(np.median(t)) for name, t in times.items()}
    chosen = int8 if ms["int8"] <= FASTER * ms["fp32"] else fp32
    log.info("%s encoder: int8 %.1f ms, float32 %.1f ms a forward on this CPU: serving %s",
             modality, ms["int8"], ms["fp32"], chosen.precision)
    return chosen


def _quantize(embedder, modality: str, fp32, data: str | Path | None = None) -> bytes:
    """The int8 graph of `fp32` (an OnnxEncoder of `modality`), calibrated on the
    checkpoint's training classes and with its validation-class parity in its metadata."""
    import onnx

    from .quantize import (
        FLOAT_FRONT,
        ParityCheck,
        calibration_files,
        calibration_sets,
        preprocessed,
        quantize_graph,
        with_metadata,
    )

    train, valid = calibration_sets(embedder.config, data)
    files = calibration_files(train, modality)
    parity_of = ParityCheck(embedder, valid, modality, fp32)  # float32's side, once
    for front in FLOAT_FRONT[modality]:  # until the parity holds; the last one is kept
        log.info("quantizing the %s encoder to int8, its first %d convolutions in float32: "
                 "%d calibration images of %d training classes", modality, front, len(files),
                 len(train.classes))
        graph = quantize_graph(fp32.data, preprocessed(embedder, files, modality), INPUT,
                               front)
        proto = onnx.load_from_string(graph)
        meta = {**{p.key: p.value for p in proto.metadata_props}, **fp32.meta,
                "precision": "int8", "calibration_images": str(len(files)),
                "float_front": str(front)}
        loaded = OnnxEncoder(with_metadata(proto, meta), fp32.meta["checkpoint_sha256"],
                             modality, precision="int8", source=f"int8 {modality} encoder")
        parity = parity_of(loaded)
        log.info("int8 %s encoder, first %d convolutions in float32: %s: %s", modality,
                 front, parity, "holds" if parity.holds() else "fails")
        if parity.holds():
            break
    return with_metadata(proto, {**meta, **parity.metadata()})
