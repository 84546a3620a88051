"""Which encoder embeds query sketches: the model bundle's ONNX graph run by ONNX Runtime on
the CPU (the default), or its PyTorch modules (CUDA). Nothing is exported, calibrated or
timed here: the bundle holds the graphs and says which precision to serve."""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from service.settings import Settings

log = logging.getLogger(__name__)


class Encoder(Protocol):
    """(N, 3, S, S) normalised sketch images -> (N, width) float32 embeddings; callable from
    several threads at once."""

    name: str
    precision: str  # fp32 or int8

    def __call__(self, batch: torch.Tensor) -> np.ndarray: ...


class TorchEncoder:
    """The sketch side of `embedder` (a bundle's PyTorch modules) on its device."""

    name = "torch"
    precision = "fp32"

    def __init__(self, embedder):
        self.embedder = embedder

    def __call__(self, batch: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return self.embedder.encode(batch, "sketch").float().cpu().numpy()


def on_cuda(settings: Settings) -> bool:
    """Whether the settings put the model on a CUDA device (None: CUDA when present)."""
    if settings.device is None:
        return torch.cuda.is_available()
    return torch.device(settings.device).type == "cuda"


def pick_encoder(settings: Settings, model) -> Encoder:
    """The sketch encoder the settings ask for, from `model` (a Bundle). auto: the bundle's
    ONNX graph on the CPU (in `settings.precision`: auto is the bundle's choice), its
    PyTorch modules on CUDA. An int8 encoder asked for that the bundle cannot serve is an
    error naming why (training.cdk.model.bundle.BundleError)."""
    cuda = on_cuda(settings)
    if settings.precision == "int8" and settings.encoder == "torch":
        raise ValueError("precision int8 is the ONNX encoder's; set encoder auto or onnx, or "
                         "precision auto or fp32")
    if settings.encoder == "torch" or (settings.encoder == "auto" and cuda):
        return TorchEncoder(model.embedder(settings.device, settings.sketch_flip_average))
    if cuda:
        raise ValueError(f"encoder=onnx runs on the CPU, but the device is {settings.device};"
                         " set --device cpu, or encoder auto or torch")
    name = model.encoder_name("sketch", settings.sketch_flip_average)
    return model.encoder(name, settings.precision, settings.threads)
