"""Which encoder embeds query sketches: the checkpoint's PyTorch modules, or its exported
graph run by ONNX Runtime on the CPU (training.cdk.model.export)."""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from service.settings import Settings
from training.cdk.model.export import EncoderMismatchError, load_or_export
from training.cdk.model.quantize import QuantizationError

log = logging.getLogger(__name__)


class Encoder(Protocol):
    """(N, 3, S, S) normalised sketch images -> (N, width) float32 embeddings; callable from
    several threads at once."""

    name: str
    precision: str  # fp32 or int8

    def __call__(self, batch: torch.Tensor) -> np.ndarray: ...


class TorchEncoder:
    """The sketch side of `embedder` in PyTorch, on its device."""

    name = "torch"
    precision = "fp32"

    def __init__(self, embedder):
        self.embedder = embedder

    def __call__(self, batch: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return self.embedder.encode(batch, "sketch").float().cpu().numpy()


def pick_encoder(settings: Settings, embedder) -> Encoder:
    """The sketch encoder the settings ask for. auto: ONNX Runtime when the model runs on
    the CPU (exported once per checkpoint and cached under the index folder; in int8 where
    `settings.precision` allows, see training.cdk.model.export.load_or_export), else
    PyTorch; PyTorch also when the export or ONNX Runtime is unavailable (with a warning).
    An exported file of another checkpoint is always an error (EncoderMismatchError), and
    so is an int8 encoder asked for that cannot be served."""
    on_cpu = embedder.device.type == "cpu"
    if settings.precision == "int8" and settings.encoder == "torch":
        raise ValueError("precision int8 is the ONNX encoder's; set encoder auto or onnx, or "
                         "precision auto or fp32")
    if settings.encoder == "torch" or (settings.encoder == "auto" and not on_cpu):
        return TorchEncoder(embedder)
    if not on_cpu:
        raise ValueError(f"encoder=onnx runs on the CPU, but the model is on {embedder.device};"
                         " set --device cpu, or encoder auto or torch")
    try:
        return load_or_export(embedder, settings.index, threads=settings.threads,
                              precision=settings.precision, data=settings.calibration_data)
    except (EncoderMismatchError, QuantizationError):
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the optional fast path
        if settings.encoder == "onnx":
            raise
        log.warning("serving sketches with PyTorch: the ONNX encoder is unavailable (%s: %s)",
                    type(err).__name__, err)
        return TorchEncoder(embedder)
