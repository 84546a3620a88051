"""A small deterministic stand-in for a model bundle (`training.cdk.model.bundle.Bundle`:
the same interface as index and service use it).

Features are 8x8 grey thumbnails (64 numbers); the "head" is a fixed seeded projection to L
scaled by decreasing weights, so coordinates are ordered like singular functions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from training.cdk.model.hubness import Hubness
from training.cdk.model.smoothing import Expansion, Smoothing


class FakeEncoder:
    """A FakeModel's side as an encoder (numpy in, numpy out), like an ONNX graph."""

    name = "fake"

    def __init__(self, model: FakeModel, modality: str, precision: str = "fp32"):
        self.model, self.modality, self.precision = model, modality, precision

    def __call__(self, images) -> np.ndarray:
        x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.asarray(images))
        return self.model.encode(x, self.modality).numpy().astype(np.float32)


class FakeModel:
    def __init__(self, L: int = 8, seed: int = 0, tag: str = "fake",
                 hubness: Hubness | None = None, sample: torch.Tensor | None = None):
        self.width = self.modes = L
        self.raw_dims = 0
        self.backbone = "fake-thumbnail"
        self.path = Path("fake-model")  # nothing there: a fake is never opened from disk
        self.training: dict = {}  # no feature cache
        self.sha256 = hashlib.sha256(f"{tag}-{L}-{seed}".encode()).hexdigest()
        self.device = torch.device("cpu")
        # no gallery smoothing; the cpu preset's query expansion
        hub = hubness or Hubness(weight=0.0)  # none unless given, with its sample
        self.inference = SimpleNamespace(
            gallery_smoothing=lambda: Smoothing(k=0), query_expansion=lambda: Expansion(),
            hubness_correction=lambda: hub,
            flip_average={"sketch": False, "photo": False}, finetuned=False)
        self._sample = torch.zeros(0, L) if sample is None else sample
        self.encoders = {m: SimpleNamespace(precision="fp32", why="a fake's graphs are float32")
                         for m in ("sketch", "photo")}  # what a Bundle records of each
        g = torch.Generator().manual_seed(seed)
        self.singular_values = torch.linspace(1.0, 0.1, L)
        self._proj = {
            m: torch.randn(64, L, generator=g) * self.singular_values for m in ("sketch", "photo")
        }

    def hubness_sample(self) -> torch.Tensor:
        return self._sample

    def describe(self) -> str:
        return f"fake model L={self.width}"

    def preprocess(self, images: list[Image.Image], modality: str) -> torch.Tensor:
        return thumbnails(images)

    def size_of(self, modality: str) -> int:
        return 8  # thumbnails' side, both modalities

    def transform(self, modality: str = "photo"):
        return thumbnails

    def encoder_name(self, modality: str, mirror: bool | None = None) -> str:
        return modality

    def encoder(self, name: str, precision: str = "auto", threads: int = 1) -> FakeEncoder:
        return FakeEncoder(self, name, "fp32" if precision == "auto" else precision)

    def embedder(self, device=None, sketch_flip_average=None,
                 photo_flip_average=None) -> FakeModel:
        return self  # its own PyTorch side

    def backbone_features(self, batch: torch.Tensor, modality: str) -> torch.Tensor:
        return batch.mean(dim=1).flatten(1) - 0.5  # (N, 64)

    def head(self, features: torch.Tensor, modality: str) -> torch.Tensor:
        return features @ self._proj[modality]  # (N, L)

    def encode(self, batch: torch.Tensor, modality: str) -> torch.Tensor:
        return self.head(self.backbone_features(batch, modality), modality)

    def embed(self, images: list[Image.Image], modality: str, batch_size: int = 64) -> np.ndarray:
        if modality not in ("sketch", "photo"):
            raise ValueError(f"modality {modality!r}")
        out = []
        for i in range(0, len(images), batch_size):
            x = self.preprocess(images[i : i + batch_size], modality)
            out.append(self.head(self.backbone_features(x, modality), modality).numpy())
        return np.concatenate(out).astype(np.float32)


def thumbnails(images: list[Image.Image]) -> torch.Tensor:
    """FakeModel's preprocessing: (N, 3, 8, 8) floats in [0, 1]."""
    arrays = [np.asarray(im.convert("RGB").resize((8, 8)), dtype=np.float32) / 255.0
              for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)


def make_gallery(root, classes=3, per_class=5, size=32, seed=0):
    """Write a tiny gallery ROOT/<class>/<id>.jpg of random-coloured blobs; returns ROOT."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        base = rng.uniform(0, 255, size=3)
        for i in range(per_class):
            pixels = np.clip(base + rng.normal(0, 60, size=(size, size, 3)), 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(d / f"c{c}_{seed}_{i:03d}.jpg")
    return root


class _RunsCode:
    """Unpickling this runs `code` (what a crafted checkpoint would do)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def crafted_checkpoint(path, marker, payload: dict | None = None):
    """A torch.save file whose unpickling would create the file `marker`; `payload` is saved
    beside the code (e.g. the format tags a loader checks first). Returns `path`."""
    code = f"open({str(marker)!r}, 'w').write('ran')"
    torch.save({**(payload or {}), "config": _RunsCode(code)}, path)
    return path
