"""Defaults of ``python -m training.cdk``: one frozen dataclass whose defaults are the
``cpu`` preset, the presets as differences from it, and the command line (training.cli:
one dashed flag per field; unknown flags or values are errors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

from training import cli

__all__ = ["Config", "PRESETS", "METHODS", "NESTING_OF", "NESTING_WEIGHTS", "nesting_weights",
           "smoothing", "sketch_flip_average", "make_config", "parse_args", "to_dict",
           "from_dict"]

# CLI method name -> nesting of training.loss.nesting_masks
NESTING_OF = {"neuralsvd-jnt": "joint", "neuralsvd-seq": "sequential", "lora": "none"}
METHODS = tuple(NESTING_OF)
PAIRINGS = ("class", "instance")
# Joint-nesting weights w_l over the prefixes l = 1..L (training.loss.nesting_masks).
# uniform: the paper's 1/L. harmonic: w_l proportional to 1/l, which puts more of the
# objective on the first prefixes (the gap m_1 - m_2 that orders mode 1 before mode 2 is
# 1/H_L ~ 1/6 instead of 1/L); any positive weights share the same global minimiser.
NESTING_WEIGHTS = ("uniform", "harmonic")
# Fields that do not change what is trained: a run may be resumed with other values.
RUNTIME_FIELDS = ("out", "threads", "cache_dir", "k", "gallery_queries", "gallery_topk",
                  "workers", "smooth_k", "smooth_weight", "smooth_rounds")
# BatchNorm while fine-tuning. frozen: every BN layer stays in eval mode with the pretrained
# running statistics (its affine weights still train); train: BN layers of the trainable
# stages use and update batch statistics.
BN_POLICIES = ("frozen", "train")


@dataclass(frozen=True)
class Config:
    """The ``cpu`` preset with neuralsvd-jnt: minutes on 2 CPU cores (a smaller head than
    the paper's, more and smaller steps, a larger lr to match)."""

    # data
    data: str = ""  # ROOT with {sketch,photo}/<class>/<file> or the Sketchy Extended layout
    split: str = "sketchy2"  # sketchy2 | sketchy1 | FILE listing test classes
    pairing: str = "class"  # class: p(x,y)=E_c[p(x|c)p(y|c)]; instance: sketch + its photo
    # backbones
    # chosen on split 2's validation classes among lite0/1/2, frozen and fine-tuned (README)
    backbone: str = "efficientnet-lite1"
    backbone_weights: str = ""  # local state-dict file; empty: packaged/torchvision weights
    image_size: int = 0  # 0: the backbone's native size (backbones.NATIVE_SIZE; 240 here)
    # frozen backbones: photo features averaged with those of the mirrored image (twice the
    # backbone's cost per photo, in training and indexing; chosen on validation)
    flip_average: bool = True
    # ... and sketch features too (twice the cost of each query). With the heads' input
    # dropout it adds nothing on validation (README), so queries take one backbone pass
    flip_average_sketches: bool = False
    # global pooling of the trunk's maps: avg | gem (generalised mean, p = 3; chosen on
    # validation: +0.026 mAP over avg, mean of three seeds)
    pooling: str = "gem"
    finetune: bool = False  # train the backbones with the heads (else cached frozen features)
    backbone_lr: float = 1e-4  # SGD lr of the backbones when finetuning
    trainable_stages: int = 0  # finetune: the last K blocks (+ final conv) train; 0: all
    bn: str = "frozen"  # finetune: BatchNorm policy, one of BN_POLICIES
    shared_backbone: bool = False  # finetune: one backbone for both modalities
    augment: bool = False  # finetune: random crops/flips (+ affine sketches, jitter photos)
    workers: int = 0  # finetune: DataLoader processes decoding images; 0: the main one
    head_epochs: int = 0  # after the epochs: heads only, on features of the final backbones
    head_lr: float = 0.05  # SGD lr of the head-only epochs (cosine to 0 over them)
    # frozen path: V augmented views of each training image, their features cached; each
    # epoch draws the plain features or one view per sampled image (0: plain only)
    feature_views: int = 0
    cache_dir: str = ".cache/cdk-features"
    # model
    method: str = "neuralsvd-jnt"
    # neuralsvd-jnt only. harmonic: in the cpu preset's budget the paper's uniform weights
    # do not order the leading modes (README, benchmark).
    nesting_weights: str = "harmonic"
    L: int = 256
    hidden: int = 1024
    mu: float = 16.0
    # dropout of the heads' standardised input features while training (embedding is
    # unaffected); chosen on validation: +0.024 smoothed mAP, mean of three seeds (README)
    input_dropout: float = 0.3
    # embeddings scaled to unit length wherever they are used for retrieval (evaluation,
    # index, service), so the full-L score is a cosine; the learned functions and their
    # singular values are not. Chosen on validation: +0.015 smoothed mAP, +0.023 P@10
    # (mean of three seeds, README)
    unit_embeddings: bool = True
    # frozen backbones: raw_dims coordinates appended after the L modes, the backbone
    # features centred per modality and projected on their top raw_dims principal axes
    # (fit on the training features of both), scaled to length sqrt(raw_weight): the full
    # score becomes cosine of the learned embeddings + raw_weight x cosine of the centred
    # features; d-prefixes with d <= L stay the learned modes alone. 0: none. Chosen on
    # validation (README)
    raw_dims: int = 256
    raw_weight: float = 1.0
    # after training, both heads' coordinates reordered by decreasing estimated singular
    # value (the CDK's Rayleigh quotients on the training set), so coordinate l is the mode
    # with the l-th largest; the order as trained and a held-out check of the sorted order
    # are reported (metrics.json). Retrieval at full dimension is unchanged (README)
    sort_modes: bool = True
    # optimisation
    # 200 epochs with weight decay: the top-32 modes near sorted, validation mAP kept (README)
    epochs: int = 200
    batch_size: int = 512
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-3
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    seed: int = 0
    # evaluation and output
    k: int = 10  # P@k; sketchy-mini has 25 photos per class, so P@10 there (paper: P@100)
    # gallery smoothing (training/cdk/model/smoothing.py): each photo embedding averaged with its
    # smooth_k nearest gallery photos, smooth_rounds times, their mean weighted smooth_weight
    # against itself; chosen on the validation classes (README). Evaluation reports it beside
    # the plain embeddings, and index.build stores smoothed photos with these values.
    # smooth_k 0 turns it off (instance-level retrieval wants the exact photo).
    smooth_k: int = 10
    smooth_weight: float = 4.0
    smooth_rounds: int = 2
    gallery_queries: int = 6
    gallery_topk: int = 8
    out: str = "runs/cdk"
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    preset: str = "cpu"  # the preset these values started from (set by make_config)


# Preset name -> its values that differ from Config(); a method name as key holds that
# method's own values within the preset. cpu: sequential nesting diverges at lr 0.05 (its
# objective climbs to ~1e3, then collapses) and is stable at 0.005; the nesting weights
# belong to joint nesting, so the other methods keep the (unused) uniform ones.
PRESETS: dict[str, dict] = {
    "cpu": {
        "neuralsvd-seq": {"lr": 0.005, "nesting_weights": "uniform"},
        "lora": {"nesting_weights": "uniform"},
    },
    # Section 4.2 / appendix: MLP 8192 -> 512, mu 16, SGD 5e-3 m 0.9 cosine, batch 4096,
    # 10 epochs, clipped gradients, uniform nesting weights; P@100 as reported on full
    # Sketchy.
    "paper": {
        "L": 512,
        "hidden": 8192,
        "batch_size": 4096,
        "epochs": 10,
        "lr": 5e-3,
        "weight_decay": 0.0,
        "nesting_weights": "uniform",
        "k": 100,
        "backbone": "vgg16",
        "finetune": True,
        "flip_average": False,
        "pooling": "avg",
        "input_dropout": 0.0,
        "unit_embeddings": False,
        "raw_dims": 0,
        "sort_modes": False,
        "workers": 8,
    },
}
DEFAULT_PRESET = "cpu"

# Fields that older checkpoints lack, with the value they were trained with where today's
# default differs (joint nesting used uniform weights before the field existed; their
# indexes were built without gallery smoothing, from average-pooled features of the image
# alone; their heads were trained without input dropout; flip_average averaged sketches too;
# their embeddings were used as the heads return them, with no raw coordinates; their
# modes kept the order they were trained in).
LEGACY = {"nesting_weights": "uniform", "smooth_k": 0, "flip_average": False, "pooling": "avg",
          "input_dropout": 0.0, "flip_average_sketches": True, "unit_embeddings": False,
          "raw_dims": 0, "sort_modes": False}


def nesting_weights(cfg: Config):
    """The w_l of joint nesting for ``cfg`` (None: nesting_masks' uniform default)."""
    if cfg.nesting_weights == "harmonic":
        import torch  # local: keep config import light

        return 1.0 / torch.arange(1, cfg.L + 1, dtype=torch.float64)
    return None


def smoothing(cfg: Config):
    """The gallery smoothing of ``cfg`` (training.cdk.model.smoothing.Smoothing)."""
    from .model.smoothing import Smoothing  # local: keep config import light

    return Smoothing(cfg.smooth_k, cfg.smooth_weight, cfg.smooth_rounds)


def _check(cfg: Config) -> Config:
    if cfg.preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {cfg.method!r}")
    if cfg.nesting_weights not in NESTING_WEIGHTS:
        raise ValueError(f"nesting_weights must be one of {NESTING_WEIGHTS}, "
                         f"got {cfg.nesting_weights!r}")
    if cfg.nesting_weights != "uniform" and cfg.method != "neuralsvd-jnt":
        raise ValueError(f"nesting_weights={cfg.nesting_weights!r} applies to neuralsvd-jnt "
                         f"only, not {cfg.method!r}")
    if cfg.pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {cfg.pairing!r}")
    from .model.backbones import BACKBONES, check_pooling  # local: keep config import light

    if cfg.backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {cfg.backbone!r}")
    check_pooling(cfg.pooling)
    if cfg.bn not in BN_POLICIES:
        raise ValueError(f"bn must be one of {BN_POLICIES}, got {cfg.bn!r}")
    # what only frozen backbones have, and what to pass instead with --finetune
    frozen_only = {"flip_average": "--flip-average false (fine-tuning augments with flips)",
                   "feature_views": "--feature-views 0 (fine-tuning augments with --augment)",
                   "raw_dims": "--raw-dims 0"}
    for name, instead in frozen_only.items():
        if cfg.finetune and getattr(cfg, name):
            raise ValueError(f"{name} applies to frozen backbones; pass {instead} with "
                             "--finetune")
    if cfg.flip_average_sketches and not cfg.flip_average:
        raise ValueError("flip_average_sketches averages sketches as well as photos; it needs "
                         "--flip-average true")
    if cfg.raw_dims and not cfg.unit_embeddings:
        raise ValueError("raw_dims weighs a cosine against the unit-length embeddings; it "
                         "needs --unit-embeddings true (or --raw-dims 0)")
    if not cfg.raw_weight > 0:
        raise ValueError(f"raw_weight must be positive, got {cfg.raw_weight!r}")
    for name in ("trainable_stages", "workers", "head_epochs", "image_size", "feature_views",
                 "raw_dims"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)!r}")
    if cfg.image_size == 0:  # resolved here, so every consumer and checkpoint sees the size
        from .model.backbones import NATIVE_SIZE

        cfg = dataclasses.replace(cfg, image_size=NATIVE_SIZE[cfg.backbone])
    if cfg.finetune:
        from .finetune import STAGES  # local: keep config import light

        if cfg.trainable_stages > STAGES[cfg.backbone]:
            raise ValueError(f"trainable_stages must be <= {STAGES[cfg.backbone]} for "
                             f"{cfg.backbone}, got {cfg.trainable_stages}")
    for name in ("L", "hidden", "epochs", "batch_size", "image_size", "k"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)!r}")
    if cfg.batch_size < 2:
        raise ValueError(f"batch_size must be >= 2 (the CDK estimator), got {cfg.batch_size}")
    smoothing(cfg)  # its own checks name the bad value
    if not 0.0 <= cfg.input_dropout < 1.0:
        raise ValueError(f"input_dropout must be in [0, 1), got {cfg.input_dropout!r}")
    for name in ("lr", "mu", "head_lr"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(cfg, name)!r}")
    return cfg


def make_config(preset: str = DEFAULT_PRESET, **overrides) -> Config:
    """The preset's values (with its values for the method), then ``overrides``, which must
    name existing fields with values of their type."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    table = PRESETS[preset]
    common = {k: v for k, v in table.items() if k not in METHODS}
    method = overrides.get("method", common.get("method", Config.method))
    return _check(cli.build(Config, common, table.get(method, {}), overrides,
                            {"preset": preset}))


def parse_args(argv: list[str] | None = None) -> Config:
    """``--FIELD VALUE`` for every Config field and ``--preset``; ``--data`` is required."""
    parser = cli.build_parser(
        Config,
        prog="python -m training.cdk",
        description="Structured sketch/photo embeddings by NestedLoRA on the CDK "
                    f"(defaults: the {DEFAULT_PRESET} preset).",
        presets=PRESETS,
        default_preset=DEFAULT_PRESET,
        choices={"method": METHODS, "pairing": PAIRINGS, "nesting_weights": NESTING_WEIGHTS,
                 "bn": BN_POLICIES},
        required=("data",),
    )
    cfg = cli.parse(parser, make_config, argv)
    if not Path(cfg.data).is_dir():
        parser.error(f"--data {cfg.data!r} is not a folder")
    if cfg.split not in ("sketchy1", "sketchy2") and not Path(cfg.split).is_file():
        parser.error(f"--split must be sketchy2, sketchy1 or an existing FILE, got {cfg.split!r}")
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
    """Rebuild a Config stored in a checkpoint (fields added later get the value older runs
    were trained with, else their defaults; keys that are no field are ignored)."""
    names = {f.name for f in fields(Config)}
    return Config(**{**LEGACY, **{k: v for k, v in d.items() if k in names}})


def sketch_flip_average(cfg: Config) -> bool:
    """Whether ``cfg`` averages sketch features with their mirror image's."""
    return cfg.flip_average and cfg.flip_average_sketches
