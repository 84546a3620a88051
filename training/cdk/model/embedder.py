"""Embed sketches and photos with a model bundle's PyTorch modules (``Bundle.embedder``):
the GPU path, the heads over cached backbone features, and the source of the exported graphs.

Retrieval score convention (used by training.cdk.metrics, the index and the service):
score(x, y; d) = <f_{1:d}(x), g_{1:d}(y)>, the plain inner product of the d-prefixes of the
sketch embedding f and the photo embedding g. With ``unit_embeddings`` (the cpu preset's
default) the heads' outputs are scaled to unit length over all modes
(model.retrieval_embedding), else used as they are; the raw coordinates (if any) follow
them. A query zero-padded past d in a flat inner-product index therefore gives exactly the
d-prefix search.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from training.device import pick_device
from training.images import images_to_tensor

from .backbones import Backbone, bare_backbone, with_flip_average
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
    """Sketch/photo embedder in PyTorch, from a bundle's inference block and weights.

    Attributes: backbone (name), singular_values (modes,), sha256 (the bundle's), device,
    image_size (the photos' input side), sketch_image_size (the sketches'; ``size_of``),
    finetuned (the backbones were trained with the heads), pooling (avg or gem),
    trained_photo_flip_average, trained_sketch_flip_average (each modality trained averaged
    with its mirror image), photo_flip_average, sketch_flip_average (so averaged as they are
    embedded now),
    unit_embeddings, modes (the learned singular functions), raw_dims (raw coordinates
    after them, model.RawProjection; 0: none) and width = modes + raw_dims. The backbones
    are built on first use: the heads alone (cached features) need none.
    """

    def __init__(self, inference, weights: dict, sha256: str, device=None,
                 source: str = "model", sketch_flip_average: bool | None = None,
                 photo_flip_average: bool | None = None):
        self.device = pick_device(device)
        inf = inference
        self.inference = inf
        self.backbone: str = inf.backbone
        self.image_size: int = inf.size_of("photo")
        self.sketch_image_size: int = inf.size_of("sketch")
        self._mean, self._std = tuple(inf.mean), tuple(inf.std)
        # features averaged with the mirror image's as trained; ``sketch_flip_average`` /
        # ``photo_flip_average`` False embeds that modality in one view even so (one backbone
        # pass an image instead of two); True never averages what was trained in one view
        self.trained_photo_flip_average: bool = bool(inf.flip_average["photo"])
        self.trained_sketch_flip_average: bool = bool(inf.flip_average["sketch"])
        self.photo_flip_average: bool = (
            self.trained_photo_flip_average if photo_flip_average is None
            else bool(photo_flip_average) and self.trained_photo_flip_average)
        self.sketch_flip_average: bool = (
            self.trained_sketch_flip_average if sketch_flip_average is None
            else bool(sketch_flip_average) and self.trained_sketch_flip_average)
        self.pooling: str = str(inf.pooling)
        self.unit_embeddings: bool = bool(inf.unit_embeddings)
        self.sha256: str = sha256
        self.finetuned: bool = bool(inf.finetuned)
        self.singular_values: torch.Tensor = torch.tensor(inf.singular_values,
                                                          dtype=torch.float32)
        self.modes: int = int(inf.modes)
        self.source = source
        self._raw: dict[str, RawProjection] | None = None
        raw = weights.get("raw")
        if inf.raw_dims and not raw:
            raise ValueError(f"{source!r} asks for {inf.raw_dims} raw coordinates but holds no "
                             "projection for them")
        if raw:
            self._raw = {m: RawProjection(raw["mean"][m], raw["axes"], float(raw["weight"]))
                         .to(self.device) for m in MODALITIES}
        self.raw_dims: int = 0 if self._raw is None else self._raw["sketch"].dims
        if self.raw_dims != inf.raw_dims:
            raise ValueError(f"{source!r}: the inference block says {inf.raw_dims} raw "
                             f"coordinates, the weights hold {self.raw_dims}")
        self.width: int = self.modes + self.raw_dims
        self._states = weights["backbones"]
        self._backbones: dict[str, Backbone] = {}
        self._heads: dict[str, Head] = {}
        head = inf.head
        for mod in MODALITIES:
            h = Head(int(head["in_dim"]), int(head["hidden"]), self.modes, float(head["mu"]))
            _load_weights(h, weights["heads"][mod], f"{source!r} {mod} head")
            self._heads[mod] = h.to(self.device).eval()

    def _backbone(self, modality: str) -> Backbone:
        """``modality``'s backbone with its weights, built on first use."""
        if modality not in self._backbones:
            shared = self._states["sketch"] is self._states["photo"]
            flips = {"sketch": self.sketch_flip_average, "photo": self.photo_flip_average}
            other = "photo" if modality == "sketch" else "sketch"
            if shared and other in self._backbones:  # one trunk, pooled per modality
                bb = with_flip_average(self._backbones[other], flips[modality])
            else:
                bb = bare_backbone(self.backbone, flips[modality], self.pooling)
                _load_weights(bb.module, self._states[modality],
                              f"{self.source!r} {modality} backbone")
                bb.module.to(self.device).eval()
            self._backbones[modality] = bb
        return self._backbones[modality]

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
        return dataclasses.replace(self._backbone(modality), mean=self._mean, std=self._std)

    @torch.no_grad()
    def backbone_features(self, batch: torch.Tensor, modality: str) -> torch.Tensor:
        """(N, 3, H, W) normalised images -> (N, D) pooled backbone features (float32)."""
        _check_modality(modality)
        module = self._backbone(modality).module
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
        return self._backbone(modality).module, self._heads[modality]

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
