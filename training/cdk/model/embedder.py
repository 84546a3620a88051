"""Embed sketches and photos with a trained CDK checkpoint.

Retrieval score convention (used by training.cdk.metrics, the index and the service):
score(x, y; d) = <f_{1:d}(x), g_{1:d}(y)>, the plain inner product of the d-prefixes of the
sketch embedding f and the photo embedding g. With the checkpoint's ``unit_embeddings``
(the cpu preset's default) the heads' outputs are scaled to unit length over all modes
(model.retrieval_embedding), else used as they are; the raw coordinates (if any) follow
them. A query zero-padded past d in a flat inner-product index therefore gives exactly the
d-prefix search.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from training.device import pick_device
from training.images import images_to_tensor

from ..config import from_dict
from .backbones import Backbone, bare_backbone, with_flip_average
from .checkpoint import read_checkpoint
from .heads import MODALITIES, Head, RawProjection, embedding

__all__ = ["Embedder"]


def _load_weights(module: torch.nn.Module, state: dict, what: str) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:  # missing/unexpected keys or shapes: name the file
        raise ValueError(f"{what} weights do not fit its architecture: {err}") from err


def _check_modality(modality: str) -> None:
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")


class Embedder:
    """Sketch/photo embedder rebuilt from a checkpoint alone.

    Attributes: backbone (name), singular_values (modes,), config (dict),
    checkpoint_sha256, device, image_size (the photos' input side), sketch_image_size
    (the sketches'; ``size_of``), trained, finetuned (the backbones were trained
    with the heads), pooling (of the backbone's maps: avg or gem), photo_flip_average
    (photos averaged with their mirror image, as trained), trained_sketch_flip_average
    (sketches trained so), sketch_flip_average (sketches so averaged as queries are
    embedded now), unit_embeddings (the modes scaled to unit length), modes (the learned
    singular functions), raw_dims (raw coordinates after them, model.RawProjection; 0:
    none) and width = modes + raw_dims, the embeddings' width.
    """

    def __init__(self, ckpt: dict, sha256: str, device=None, source: str = "checkpoint",
                 sketch_flip_average: bool | None = None):
        self.device = pick_device(device)
        meta = ckpt["backbone"]
        self.backbone: str = meta["name"]
        self.image_size: int = int(meta["image_size"])
        self.sketch_image_size: int = int(meta.get("sketch_image_size") or self.image_size)
        self._mean, self._std = tuple(meta["mean"]), tuple(meta["std"])
        # features averaged with the mirror image's as trained; ``sketch_flip_average``
        # False embeds sketches alone even so (a query costs one backbone pass instead of
        # two, at some accuracy)
        self.photo_flip_average: bool = bool(meta["photo_flip_average"])
        self.trained_sketch_flip_average: bool = bool(meta["sketch_flip_average"])
        self.sketch_flip_average: bool = (
            self.trained_sketch_flip_average if sketch_flip_average is None
            else bool(sketch_flip_average) and self.trained_sketch_flip_average)
        self.pooling: str = str(meta["pooling"])
        self.config: dict = dict(ckpt["config"])
        config = from_dict(self.config, source)
        self.unit_embeddings: bool = config.unit_embeddings
        self.checkpoint_sha256: str = sha256
        self.trained: bool = bool(ckpt["trained"])
        self.finetuned: bool = bool(meta["finetuned"])
        self.singular_values: torch.Tensor = ckpt["singular_values"].float().cpu()
        arch = ckpt["head_arch"]
        self.modes: int = int(arch["modes"])
        self._raw: dict[str, RawProjection] | None = None
        raw = ckpt["raw"]
        if config.raw_dims and not raw:
            raise ValueError(f"{source!r} asks for raw coordinates (raw_dims) but holds no "
                             "projection for them; train it again")
        if raw:
            self._raw = {m: RawProjection(raw["mean"][m], raw["axes"], float(raw["weight"]))
                         .to(self.device) for m in MODALITIES}
        self.raw_dims: int = 0 if self._raw is None else self._raw["sketch"].dims
        self.width: int = self.modes + self.raw_dims

        self._backbones: dict[str, Backbone] = {}
        shared = ckpt["backbones"]["sketch"] is ckpt["backbones"]["photo"]
        flips = {"sketch": self.sketch_flip_average, "photo": self.photo_flip_average}
        for mod in MODALITIES:
            if shared and mod == "photo":  # one trunk, pooled as the photos were trained
                self._backbones[mod] = with_flip_average(self._backbones["sketch"],
                                                         flips[mod])
                continue
            bb = bare_backbone(self.backbone, flips[mod], self.pooling)
            _load_weights(bb.module, ckpt["backbones"][mod], f"{source!r} {mod} backbone")
            self._backbones[mod] = bb
        self._heads: dict[str, Head] = {}
        for mod in MODALITIES:
            head = Head(int(arch["in_dim"]), int(arch["hidden"]), self.modes,
                        float(arch["mu"]))
            _load_weights(head, ckpt["heads"][mod], f"{source!r} {mod} head")
            self._heads[mod] = head.to(self.device).eval()
        for bb in {id(b.module): b for b in self._backbones.values()}.values():
            bb.module.to(self.device).eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, device=None,
                        sketch_flip_average: bool | None = None) -> Embedder:
        """Rebuild backbones and heads from ``path``; ValueError if it is not a CDK checkpoint.
        The hash is of the bytes loaded (one read), not of a second read of the file.
        ``sketch_flip_average``: None as trained; False: query sketches alone (see the
        attribute)."""
        path = Path(path)
        ckpt, sha256 = read_checkpoint(path)
        return cls(ckpt, sha256, device, source=str(path),
                   sketch_flip_average=sketch_flip_average)

    def size_of(self, modality: str) -> int:
        """The side ``modality``'s images are resized to (H = W) before the backbone."""
        _check_modality(modality)
        return self.sketch_image_size if modality == "sketch" else self.image_size

    def preprocess(self, images: list[Image.Image], modality: str) -> torch.Tensor:
        """PIL images (any mode; transparent sketch pixels -> white) -> (N, 3, S, S) on
        device, S = ``size_of(modality)``."""
        x = images_to_tensor(images, self.size_of(modality), self._mean, self._std)
        return x.to(self.device)

    def transform(self, modality: str = "photo") -> Callable[[list[Image.Image]], torch.Tensor]:
        """preprocess on the CPU as a picklable function (for DataLoader workers): PIL images
        -> (N, 3, S, S) float32."""
        return functools.partial(images_to_tensor, size=self.size_of(modality),
                                 mean=self._mean, std=self._std)

    def backbone_of(self, modality: str) -> Backbone:
        """``modality``'s backbone (name, module, feature_dim) with the normalisation this
        embedder applies, e.g. for training.cdk.features' cache keys."""
        _check_modality(modality)
        return dataclasses.replace(self._backbones[modality], mean=self._mean, std=self._std)

    @torch.no_grad()
    def backbone_features(self, batch: torch.Tensor, modality: str) -> torch.Tensor:
        """(N, 3, H, W) normalised images -> (N, D) pooled backbone features (float32)."""
        _check_modality(modality)
        module = self._backbones[modality].module
        with torch.autocast(self.device.type, enabled=self.device.type == "cuda"):
            return module(batch.to(self.device)).float()

    @torch.no_grad()
    def head(self, features: torch.Tensor, modality: str) -> torch.Tensor:
        """(N, D) backbone features -> (N, width) embedding: f for sketches, g for photos
        (scaled to unit length when the checkpoint's ``unit_embeddings`` says so), then the
        raw coordinates."""
        _check_modality(modality)
        x = features.to(self.device).float()
        return embedding(self._heads[modality](x), x, self.unit_embeddings,
                         self.raw_projection(modality))  # (N, modes + raw_dims)

    def encode(self, batch: torch.Tensor, modality: str) -> torch.Tensor:
        """(N, 3, H, W) normalised images -> (N, width) embedding: backbone, then head."""
        return self.head(self.backbone_features(batch, modality), modality)

    def modules(self, modality: str) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The (backbone, head) modules of `modality`, e.g. for export (training.cdk.model.export);
        the head returns the learned functions (``head`` also applies ``unit_embeddings``
        and appends ``raw_projection``'s coordinates)."""
        _check_modality(modality)
        return self._backbones[modality].module, self._heads[modality]

    def raw_projection(self, modality: str) -> RawProjection | None:
        """`modality`'s raw-coordinate projection (None: the checkpoint has none)."""
        _check_modality(modality)
        return None if self._raw is None else self._raw[modality]

    def embed(self, images: list[Image.Image], modality: str, batch_size: int = 64) -> np.ndarray:
        """Images -> float32 array (N, width); coordinate i < modes is the i-th learned
        singular function, the raw coordinates (if any) follow."""
        _check_modality(modality)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = [np.zeros((0, self.width), dtype=np.float32)]
        for i in range(0, len(images), batch_size):
            x = self.preprocess(images[i : i + batch_size], modality)
            z = self.encode(x, modality)
            out.append(z.cpu().numpy().astype(np.float32))
        return np.concatenate(out, axis=0)
