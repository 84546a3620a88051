"""Static int8 quantization of an exported encoder graph, and its parity with float32.

The graph of `training.cdk.model.export` is quantized by ONNX Runtime in the QDQ format:
weights int8 per output channel, activations uint8 with ranges from MinMax calibration (the
x86 kernels with VNNI multiply uint8 by int8 without saturation). Only the backbone's
convolutions and the activations and additions between them are quantized; pooling, the head
and the raw coordinates stay float32 (a few matrix products, not worth their error).

Calibration images are of the model's training classes only; the parity is measured on its
validation classes, never on test classes, when the model bundle is written
(training.cdk.make_bundle), where the training data is:

  - validation mAP@all of int8 `modality` embeddings against float32 embeddings of the other
    modality within PARITY_MAP_DROP of the float32 mAP, and
  - mean overlap of each validation sketch's top-10 photos, float32 against int8, at least
    PARITY_OVERLAP.

The error of an int8 graph starts in its first layers. On sketches (thin strokes on white)
the fully quantized backbone keeps a top-10 overlap of 0.81-0.83; with its first 5, 8, 16
or 32 of 64 convolutions in float32 it keeps 0.90 / 0.90 / 0.92 / 0.93 on the quick start's
model and 0.91 / 0.91 / 0.93 / - on split 2's (seed 0), while keeping the last 8 or 16 in
float32 instead changes nothing (0.81). So a graph is quantized with its first K
convolutions left in float32, K taken in turn from FLOAT_FRONT[modality] until the parity
holds: 16 for sketches (8 misses on the quick start's model, 0.899), none for photos (they
hold it fully quantized, 0.92-0.93). The numbers and K are stored in the
quantized graph's metadata and in the bundle; a graph whose parity fails at every K is kept
in the bundle, with its evidence, but never served.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from training.folders import DataError

from .data import Dataset, scan
from .metrics import retrieval_metrics
from .splits import split_classes

__all__ = ["FLOAT_FRONT", "PARITY_MAP_DROP", "PARITY_OVERLAP", "Parity", "ParityCheck",
           "QuantizationError", "calibration_files", "calibration_sets", "images_of",
           "preprocessed", "quantize_graph", "with_metadata"]

log = logging.getLogger(__name__)

CALIBRATION_IMAGES = 128  # training-class images, drawn with a fixed seed
PARITY_MAP_DROP = 0.01
PARITY_OVERLAP = 0.9
TOP = 10
QUANTIZED_OPS = ["Conv", "Clip", "Add"]  # the backbone: convolutions, ReLU6, residual adds
# the leading convolutions kept in float32, tried in this order until the parity holds
FLOAT_FRONT = {"sketch": (16, 32), "photo": (0, 16)}

Encode = Callable[[np.ndarray], np.ndarray]  # (N, 3, S, S) float32 -> (N, width) float32


class QuantizationError(RuntimeError):
    """The int8 graph cannot be made (no calibration data) or does not hold parity."""


@dataclass(frozen=True)
class Parity:
    """Validation-class retrieval with the float32 and the int8 graph of one modality."""

    map_fp32: float
    map_int8: float
    overlap: float  # mean share of the float32 top-10 photos in the int8 top-10
    queries: int  # validation sketches

    def holds(self) -> bool:
        return (self.map_fp32 - self.map_int8 <= PARITY_MAP_DROP
                and self.overlap >= PARITY_OVERLAP)

    def __str__(self) -> str:
        return (f"validation mAP {self.map_int8:.4f} (float32 {self.map_fp32:.4f}), top-{TOP} "
                f"overlap {self.overlap:.3f} over {self.queries} sketches")

    def metadata(self) -> dict[str, str]:
        return {"parity_map_fp32": f"{self.map_fp32:.6f}",
                "parity_map_int8": f"{self.map_int8:.6f}",
                "parity_overlap": f"{self.overlap:.6f}", "parity_queries": str(self.queries)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Parity:
        return cls(float(meta["parity_map_fp32"]), float(meta["parity_map_int8"]),
                   float(meta["parity_overlap"]), int(meta["parity_queries"]))

    def as_dict(self) -> dict:
        """What a model bundle records of it (``holds`` included)."""
        return {"map_fp32": round(self.map_fp32, 6), "map_int8": round(self.map_int8, 6),
                "overlap": round(self.overlap, 6), "queries": self.queries,
                "holds": self.holds(), "max_map_drop": PARITY_MAP_DROP,
                "min_overlap": PARITY_OVERLAP}


def calibration_sets(root: str | Path | None, split: str) -> tuple[Dataset, Dataset]:
    """(training classes, validation classes) of the training data at ``root`` under the
    class split ``split`` (training.cdk.splits); QuantizationError when there is no such
    folder or no validation class to measure parity on."""
    if not root or not Path(root).is_dir():
        raise QuantizationError(f"calibrating int8 needs the training data; {str(root)!r} is "
                                "not a folder")
    try:
        dataset = scan(root)
    except DataError as err:
        raise QuantizationError(f"calibrating int8 needs the training data: {err}") from err
    try:
        parts = split_classes(str(split), list(dataset.classes))
    except ValueError as err:
        raise QuantizationError(f"calibrating int8 needs the training data: {err}") from err
    if not parts["valid"]:
        raise QuantizationError(f"split {split!r} of {str(root)!r} has no validation classes "
                                "to measure int8 parity on")
    return dataset.restrict(parts["train"]), dataset.restrict(parts["valid"])


def _files(dataset: Dataset, modality: str) -> tuple[tuple[Path, ...], np.ndarray]:
    if modality == "sketch":
        return dataset.sketches, dataset.sketch_labels
    return dataset.photos, dataset.photo_labels


def images_of(files, size: int = 16) -> Iterator[list[Image.Image]]:
    """The image files as RGB images, `size` at a time, in order."""
    for i in range(0, len(files), size):
        images = []
        for f in files[i : i + size]:
            with Image.open(f) as im:
                images.append(im.convert("RGB"))
        yield images


def preprocessed(preprocess: Callable, files, modality: str) -> Iterator[np.ndarray]:
    """(N, 3, S, S) float32 batches of the image files, as ``preprocess(images, modality)``
    (a Bundle's or an Embedder's) makes them."""
    for images in images_of(files):
        yield np.asarray(preprocess(images, modality).cpu(), dtype=np.float32)


def quantize_graph(fp32: bytes, calibration: Iterator[np.ndarray], input_name: str,
                   float_front: int = 0) -> bytes:
    """The int8 QDQ graph of the float32 graph `fp32`, calibrated on the batches given, with
    every node up to its `float_front`-th convolution (graph order) left in float32."""
    from onnxruntime.quantization import (  # local: serving float32 does not need it
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def get_next(self) -> dict | None:
            batch = next(calibration, None)
            return None if batch is None else {input_name: batch}

    with tempfile.TemporaryDirectory(prefix="sketchsvd-quantize-") as tmp:
        src, pre, out = (Path(tmp) / n for n in ("fp32.onnx", "pre.onnx", "int8.onnx"))
        src.write_bytes(fp32)
        # Shapes and constant folding first (ONNX Runtime's advice); the symbolic shape
        # pass does not handle the exporter's dynamic batch dimension.
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax,
                        op_types_to_quantize=QUANTIZED_OPS,
                        nodes_to_exclude=front_nodes(pre, float_front))
        return out.read_bytes()


def front_nodes(graph: str | Path, convs: int) -> list[str]:
    """The names of the nodes of the ONNX file `graph` up to and including its `convs`-th
    convolution, in graph order (none for 0)."""
    import onnx

    if convs <= 0:
        return []
    nodes = onnx.load(str(graph)).graph.node
    positions = [i for i, n in enumerate(nodes) if n.op_type == "Conv"]
    if convs > len(positions):
        raise ValueError(f"float_front={convs}: the graph has {len(positions)} convolutions")
    return [n.name for n in nodes[: positions[convs - 1] + 1]]


def calibration_files(train: Dataset, modality: str, n: int = CALIBRATION_IMAGES
                      ) -> list[Path]:
    """`n` images of `modality` from the training classes, drawn with a fixed seed."""
    files, _ = _files(train, modality)
    if not files:
        raise QuantizationError(f"no {modality} images in the training classes of "
                                f"{str(train.root)!r}")
    pick = np.random.default_rng(0).choice(len(files), min(n, len(files)), replace=False)
    return [files[i] for i in sorted(pick)]


class ParityCheck:
    """The float32 side of a parity measurement of ``modality`` on the validation classes:
    ``ours`` (N, width), float32 embeddings of this modality's validation ``files`` (in
    order), ``theirs`` (M, width) those of the other modality, and their labels. Made once;
    calling it with an int8 graph embeds ``files`` with it (``preprocess`` as served) and
    gives that graph's Parity, so several int8 candidates cost one float32 pass."""

    def __init__(self, modality: str, files, ours: np.ndarray, theirs: np.ndarray,
                 own_labels: np.ndarray, other_labels: np.ndarray, preprocess: Callable):
        self.modality, self.files, self.preprocess = modality, list(files), preprocess
        self.theirs = np.asarray(theirs, dtype=np.float32)
        # queries are sketches, the gallery photos
        self.q_labels, self.g_labels = ((own_labels, other_labels) if modality == "sketch"
                                        else (other_labels, own_labels))
        self.top = min(TOP, len(self.g_labels))
        self.map_fp32, self.tops_fp32 = self._retrieval(np.asarray(ours, dtype=np.float32))

    def _retrieval(self, ours: np.ndarray) -> tuple[float, np.ndarray]:
        f, g = (ours, self.theirs) if self.modality == "sketch" else (self.theirs, ours)
        m = retrieval_metrics(f, g, self.q_labels, self.g_labels, TOP)["map_all"]
        return m, np.argsort(-(f @ g.T), axis=1, kind="stable")[:, : self.top]

    def __call__(self, int8: Encode) -> Parity:
        ours = np.concatenate([int8(b) for b in
                               preprocessed(self.preprocess, self.files, self.modality)])
        map_int8, tops = self._retrieval(ours)
        overlap = np.mean([len(set(a) & set(b)) / self.top
                           for a, b in zip(self.tops_fp32, tops, strict=True)])
        return Parity(self.map_fp32, map_int8, float(overlap), len(self.q_labels))


def with_metadata(proto, meta: dict[str, str]) -> bytes:
    del proto.metadata_props[:]
    for key, value in sorted(meta.items()):
        proto.metadata_props.add(key=key, value=value)
    return proto.SerializeToString()
