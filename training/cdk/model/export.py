"""An encoder (backbone + head) as one ONNX graph, run on the CPU by ONNX Runtime, in float32
or int8.

A query's cost on the CPU is its backbone forward. PyTorch's eager CPU kernels for the
EfficientNet-Lite blocks are 2-4x slower than ONNX Runtime's fused ones on the same thread
count (benchmarks/encoder_bench.py), so sketches and photos are embedded on the CPU by this
graph, exported with `torch.onnx.export` (torch.export based) when the model bundle is
written (training.cdk.make_bundle) and read from the bundle by index and service.

The graph's metadata records its format, modality, width, input side, whether it averages
over the mirror image, whether it scales embeddings to unit length and its precision;
loading a graph of another format, modality, precision or width is an
EncoderMismatchError naming both values. Float32 embeddings agree with PyTorch's to ~1e-6;
the int8 graph (training.cdk.quantize) is calibrated and its parity measured when the bundle
is written.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .heads import embedding

__all__ = ["EncoderMismatchError", "OnnxEncoder", "export_encoder", "export_module", "session"]

FORMAT = "sketchsvd-encoder-4"  # bump when the graph's inputs, outputs or meaning change
INPUT, OUTPUT = "images", "embedding"  # (N, 3, S, S) normalised images -> (N, width)
MAX_BATCH = 1024  # the exported batch axis is dynamic up to this


class EncoderMismatchError(ValueError):
    """A graph that is not the encoder asked for (another format, modality, precision or
    width), or not a loadable ONNX model."""


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


def export_module(module: nn.Module, size: int, metadata: dict[str, str]) -> bytes:
    """A float32 module of (N, 3, size, size) images as ONNX model bytes (the batch axis
    dynamic up to MAX_BATCH), with `metadata`."""
    module = copy.deepcopy(module).cpu().float().eval()
    example = torch.zeros(2, 3, size, size)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    program = torch.onnx.export(module, (example,), input_names=[INPUT],
                                output_names=[OUTPUT], dynamic_shapes=({0: batch},),
                                dynamo=True, verbose=False)
    program.model.metadata_props.update({"format": FORMAT, "image_size": str(size),
                                         **metadata})
    return program.model_proto.SerializeToString()


def export_encoder(embedder, modality: str = "sketch") -> bytes:
    """The float32 `modality` encoder of `embedder` (a training.cdk Embedder) as ONNX model
    bytes, with its modality, width, input side and mirror averaging in its metadata."""
    backbone, head = embedder.modules(modality)  # on the embedder's device
    raw = embedder.raw_projection(modality)
    unit = embedder.unit_embeddings
    return export_module(_Encoder(backbone, head, unit, raw), embedder.size_of(modality), {
        "modality": modality, "width": str(embedder.width),
        "flip_average": str(_flip(embedder, modality)), "unit_embeddings": str(unit),
        "precision": "fp32"})


def session(model: bytes, threads: int = 1, source: str = "graph"):
    """An ONNX Runtime session of `model` on the CPU computing on `threads` threads."""
    import onnxruntime as ort  # local: training and the torch path do not need it

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - ORT raises its own types; name the file
        raise EncoderMismatchError(f"{source} is not a loadable ONNX model: {err}") from err


class OnnxEncoder:
    """An exported encoder run by ONNX Runtime on the CPU: (N, 3, S, S) float32 images ->
    (N, width) float32 embeddings. `__call__` may be called from several threads at once; each
    call computes on `threads` threads. `precision` is the graph's (fp32 or int8); `meta`
    its metadata."""

    name = "onnxruntime"

    def __init__(self, model: bytes | str | Path, modality: str = "sketch", threads: int = 1,
                 source: str = "encoder", precision: str = "fp32", width: int | None = None):
        self.data = model if isinstance(model, bytes) else Path(model).read_bytes()
        self.session = session(self.data, threads, source)
        self.meta = meta = self.session.get_modelmeta().custom_metadata_map
        expected = {"format": FORMAT, "modality": modality, "precision": precision}
        if width is not None:
            expected["width"] = str(width)
        wrong = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
        if wrong:
            raise EncoderMismatchError(
                f"{source} is not the encoder asked for: it has "
                + ", ".join(f"{k}={v!r}" for k, v in wrong.items()) + "; expected "
                + ", ".join(f"{k}={expected[k]!r}" for k in wrong))
        self.width = int(meta["width"])
        self.image_size = int(meta["image_size"])
        self.precision = precision
        self.source = source

    def __call__(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        x = images.numpy(force=True) if isinstance(images, torch.Tensor) else images
        return self.session.run([OUTPUT], {INPUT: np.ascontiguousarray(x, np.float32)})[0]
