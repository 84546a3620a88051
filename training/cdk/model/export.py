"""The sketch encoder (backbone + head) as one ONNX graph, run on the CPU by ONNX Runtime.

A query's cost on the CPU is its backbone forward. PyTorch's eager CPU kernels for the
EfficientNet-Lite blocks are 2-4x slower than ONNX Runtime's fused ones on the same
thread count (benchmarks/service_bench.py --compare), so the service serves queries on the
CPU through this graph, exported once from the checkpoint with `torch.onnx.export`
(torch.export based) and cached as a file:

    <index>/encoders/sketch-<first 16 hex of the checkpoint sha256>.onnx

The file records the full checkpoint hash, the modality, L, whether it averages over the
mirror image and whether it scales embeddings to unit length in its metadata; loading it
for another checkpoint (or mirror setting) is an EncoderMismatchError that names both
values. A mirror-averaging checkpoint served with
single-view queries has its own file, ``<modality>-<sha16>-single-view.onnx``. ONNX Runtime
computes in float32 as PyTorch does (embeddings agree to ~1e-6; tests/service/test_encoder.py).
OpenVINO's CPU plugin is as fast as ONNX Runtime in float32 and about 1.8x faster only in
its default bf16 precision on CPUs that have it, which moves embeddings by ~3% of their
scale and with them the rankings; it is not used.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from training.files import atomic_write_bytes

from .heads import embedding

__all__ = ["EncoderFormatError", "EncoderMismatchError", "OnnxEncoder", "encoder_path",
           "export_encoder", "load_or_export"]

log = logging.getLogger(__name__)

FORMAT = "sketchsvd-encoder-2"  # bump when the graph's inputs, outputs or meaning change
INPUT, OUTPUT = "images", "embedding"  # (N, 3, S, S) normalised images -> (N, width)
MAX_BATCH = 1024  # the exported batch axis is dynamic up to this


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


def export_encoder(embedder, modality: str = "sketch") -> bytes:
    """The `modality` encoder of `embedder` (a training.cdk Embedder) as ONNX model bytes,
    with the checkpoint hash, modality, width and image size in its metadata."""
    modules = embedder.modules(modality)  # (backbone, head) on the embedder's device
    unit = embedder.unit_embeddings
    raw = embedder.raw_projection(modality)
    raw = None if raw is None else copy.deepcopy(raw).cpu().float()
    model = _Encoder(*(copy.deepcopy(m).cpu().float() for m in modules), unit, raw).eval()
    size = embedder.image_size
    example = torch.zeros(2, 3, size, size)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    program = torch.onnx.export(model, (example,), input_names=[INPUT], output_names=[OUTPUT],
                                dynamic_shapes=({0: batch},), dynamo=True, verbose=False)
    program.model.metadata_props.update({
        "format": FORMAT, "checkpoint_sha256": embedder.checkpoint_sha256,
        "modality": modality, "width": str(embedder.width), "image_size": str(size),
        "flip_average": str(bool(getattr(embedder, "flip_average", False))),
        "unit_embeddings": str(unit),
    })
    return program.model_proto.SerializeToString()


def encoder_path(index: str | Path, checkpoint_sha256: str, modality: str = "sketch",
                 single_view: bool = False) -> Path:
    """Where the exported encoder of a checkpoint is cached for the index folder `index`
    (`single_view`: the graph of a mirror-averaging checkpoint that embeds images alone)."""
    tail = "-single-view" if single_view else ""
    return Path(index) / "encoders" / f"{modality}-{checkpoint_sha256[:16]}{tail}.onnx"


def _single_view(embedder) -> bool:
    return bool(getattr(embedder, "trained_flip_average", False)) and not embedder.flip_average


class OnnxEncoder:
    """An exported encoder run by ONNX Runtime on the CPU: (N, 3, S, S) float32 images ->
    (N, width) float32 embeddings. `__call__` may be called from several threads at once; each
    call computes on `threads` threads."""

    name = "onnxruntime"

    def __init__(self, model: bytes | str | Path, checkpoint_sha256: str,
                 modality: str = "sketch", threads: int = 1, source: str = "encoder",
                 flip_average: bool | None = None):
        import onnxruntime as ort  # local: training and the torch path do not need it

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        data = model if isinstance(model, bytes) else Path(model).read_bytes()
        try:
            self.session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 - ORT raises its own types; name the file
            raise EncoderMismatchError(f"{source} is not a loadable ONNX model: {err}") from err
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("format") != FORMAT:
            raise EncoderFormatError(
                f"{source} is an encoder graph of format {meta.get('format')!r}; this code "
                f"reads {FORMAT!r}. Delete the file to have it exported again")
        expected = {"checkpoint_sha256": checkpoint_sha256, "modality": modality}
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
        self.source = source

    def __call__(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        x = images.numpy(force=True) if isinstance(images, torch.Tensor) else images
        return self.session.run([OUTPUT], {INPUT: np.ascontiguousarray(x, np.float32)})[0]


def load_or_export(embedder, index: str | Path, threads: int = 1,
                   modality: str = "sketch") -> OnnxEncoder:
    """The cached encoder of `embedder`'s checkpoint for the index at `index`, exported and
    saved there first when absent. A cached file for another checkpoint is refused
    (EncoderMismatchError). An index folder that cannot be written (a read-only volume)
    gets an encoder exported into memory, with a warning: nothing is lost but the start-up
    time of the next start."""
    path = encoder_path(index, embedder.checkpoint_sha256, modality, _single_view(embedder))
    sha, flip = embedder.checkpoint_sha256, bool(getattr(embedder, "flip_average", False))
    if path.is_file():
        log.info("%s encoder from %s", modality, path)
        try:
            return OnnxEncoder(path, sha, modality, threads, source=str(path),
                               flip_average=flip)
        except EncoderFormatError as err:
            log.info("exporting it again: %s", err)
    log.info("exporting the %s encoder to ONNX (once per checkpoint)", modality)
    data = export_encoder(embedder, modality)
    try:
        atomic_write_bytes(data, path)
        log.info("saved %s (%.1f MB)", path, len(data) / 1e6)
    except OSError as err:
        log.warning("cannot save the exported encoder at %s (%s): using it from memory; "
                    "the next start exports it again", path, err)
    return OnnxEncoder(data, sha, modality, threads, source=f"exported {modality} encoder",
                       flip_average=flip)
