"""Defaults of ``python -m training.cdk``: one frozen dataclass whose defaults are the
``cpu`` preset, the presets as differences from it, and the command line (training.cli:
one dashed flag per field; unknown flags or values are errors).

The fields fall in four groups: the paper's method (section 4.2 and its appendix), what
the product adds on top of it (each chosen on validation classes; docs/retrieval-training.md
has the evidence), fine-tuning the backbones, and the run itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from training import cli

__all__ = ["Config", "PRESETS", "PRESET_REASONS", "METHODS", "NESTING_OF", "NESTING_WEIGHTS",
           "expansion", "hubness", "fit_warnings", "nesting_weights", "smoothing", "make_config",
           "parse_args", "input_size", "to_dict", "from_dict"]

# CLI method name -> nesting of training.loss.nesting_masks
NESTING_OF = {"neuralsvd-jnt": "joint", "neuralsvd-seq": "sequential", "lora": "none"}
METHODS = tuple(NESTING_OF)
PAIRINGS = ("class", "instance")
# Joint-nesting weights w_l over the prefixes l = 1..modes (training.loss.nesting_masks).
# uniform: the paper's 1/modes. harmonic: w_l proportional to 1/l, which puts more of the
# objective on the first prefixes (the gap m_1 - m_2 that orders mode 1 before mode 2 is
# 1/H_modes ~ 1/6 instead of 1/modes); any positive weights share the same global minimiser.
NESTING_WEIGHTS = ("uniform", "harmonic")
# Fields that do not change what is trained: a run may be resumed with other values.
RUNTIME_FIELDS = ("out", "threads", "cache_dir", "k", "gallery_queries", "gallery_topk",
                  "workers", "smooth_k", "smooth_weight", "smooth_rounds", "expand_n",
                  "expand_weight", "int8", "hubness_weight", "hubness_k", "hubness_sample")


@dataclass(frozen=True)
class Config:
    """The ``cpu`` preset with neuralsvd-jnt: minutes on 2 CPU cores, seconds on a GPU
    (frozen backbone features, a smaller head than the paper's, more and smaller steps, a
    larger lr to match)."""

    # -- the paper's method: NestedLoRA on the canonical dependence kernel (section 4.2)
    data: str = ""  # ROOT with {sketch,photo}/<class>/<file> or the Sketchy Extended layout
    # sketchy2 | sketchy1 | FILE listing test classes | none (no test classes: every class
    # but the validation classes trains, for a model that serves the classes it saw)
    split: str = "sketchy2"
    # the kernel's p(x, y). class: E_c[p(x|c) p(y|c)] (the paper's); instance: each sketch
    # with the photo it was drawn from
    pairing: str = "class"
    # class pairing only: the share a of pairs that are a sketch and the photo it was drawn
    # from, p = (1 - a) p_class + a p_instance, whose rank is not capped at classes - 1; 0.5
    # chosen on the class folds (docs/retrieval-training.md). Data whose sketches do not
    # name their photo (<photo>-<n>) train with 0, with a warning
    instance_share: float = 0.5
    # model.backbones.BACKBONES; chosen on split 2's validation classes among lite0/1/2,
    # frozen and fine-tuned (the paper: VGG16)
    backbone: str = "efficientnet-lite1"
    backbone_weights: str = ""  # local state-dict file; empty: packaged/torchvision weights
    image_size: int = 0  # 0: the backbone's native size (240 for lite1)
    # the side sketches are embedded at (0: image_size). A query's backbone pass costs about
    # the square of it; photos keep image_size. Frozen backbones only
    sketch_image_size: int = 0
    method: str = "neuralsvd-jnt"  # neuralsvd-jnt | neuralsvd-seq | lora (no nesting)
    # neuralsvd-jnt only. harmonic: in the cpu preset's budget the paper's uniform weights
    # do not order the leading modes
    nesting_weights: str = "harmonic"
    modes: int = 256  # learned singular functions per modality (the paper: 512)
    hidden: int = 1024  # the heads' hidden units (one hidden layer; the paper: 8192)
    mu: float = 16.0  # the heads' output norm cap ||f(x)|| <= mu (the paper's)
    # SGD with momentum, cosine lr to 0 over the run, gradient norm clipped (0: not):
    # the paper's optimiser. 200 epochs with weight decay: the top-32 modes near sorted,
    # validation mAP kept
    epochs: int = 200
    batch_size: int = 512
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-3
    grad_clip: float = 1.0
    seed: int = 0
    k: int = 10  # P@k; sketchy-mini has 25 photos per class, so P@10 there (paper: P@100)

    # -- the product's additions (each chosen on validation classes)
    # global pooling of the trunk's maps: avg | gem (generalised mean, p = 3)
    pooling: str = "gem"
    # photo features averaged with those of the mirrored photo (twice the backbone's cost
    # per photo, once, at training and indexing)
    photo_flip_average: bool = True
    # ... and sketch features (twice the cost of every query). With the input dropout it
    # adds nothing on validation, so queries take one backbone pass
    sketch_flip_average: bool = False
    # dropout of the heads' standardised input features while training (embedding is
    # unaffected)
    input_dropout: float = 0.3
    # embeddings scaled to unit length wherever they are used for retrieval (evaluation,
    # index, service), so the full score is a cosine; the learned functions and their
    # singular values are not
    unit_embeddings: bool = True
    # raw_dims coordinates appended after the learned modes: the backbone features centred
    # per modality and projected on their top raw_dims principal axes (fit on the training
    # features of both), each axis divided by its standard deviation to the power
    # raw_whiten (0: plain PCA, 1: full whitening), scaled to length sqrt(raw_weight). The
    # full score becomes the learned cosine + raw_weight x the cosine of the projected
    # features; d-prefixes with d <= modes stay the learned modes alone. 0: none. Frozen
    # backbones only. Whitening 0.5 with weight 2 chosen on the class folds and validation
    # classes (docs/retrieval-training.md)
    raw_dims: int = 256
    raw_weight: float = 2.0
    raw_whiten: float = 0.5
    # after training, both heads' coordinates reordered by decreasing estimated singular
    # value (the CDK's Rayleigh quotients on the training set), so coordinate l is the mode
    # with the l-th largest; metrics.json keeps the order as trained and a held-out check
    sort_modes: bool = True
    # gallery smoothing (model.smoothing): each photo embedding averaged with its smooth_k
    # nearest gallery photos, smooth_rounds times, their mean weighted smooth_weight against
    # itself. Evaluation reports it beside the plain embeddings, and index.build stores the
    # smoothed photos. 0 turns it off (instance-level retrieval wants the exact photo)
    smooth_k: int = 10
    smooth_weight: float = 4.0
    smooth_rounds: int = 2
    # query expansion (model.smoothing): the service moves each query toward the mean of
    # its expand_n best photos, weighted expand_weight, and ranks again. Evaluation
    # reports it as "service". 0 turns it off
    expand_n: int = 5
    expand_weight: float = 0.5
    # hubness correction at search time (model.hubness, cross-domain similarity local
    # scaling): each stored photo's score lowered by hubness_weight x its mean score against
    # its hubness_k nearest sketches of a fixed sample of training sketches (at most
    # hubness_sample of them, evenly spread), which training writes beside the model. Photos
    # of the trained classes crowd the answers to a sketch of a class never seen; this
    # lowers them. Evaluation reports it as "corrected". 0 turns it off. Weight 0.5 (CSLS's
    # own) and k = 10 chosen on the class folds and validation classes
    # (docs/retrieval-training.md): a heavier weight costs the zero-shot numbers
    hubness_weight: float = 0.5
    hubness_k: int = 10
    hubness_sample: int = 4096

    # -- fine-tuning the backbones with the heads (else cached frozen features). Every
    # BatchNorm layer keeps its pretrained statistics
    finetune: bool = False
    backbone_lr: float = 1e-4  # SGD lr of the backbones
    trainable_stages: int = 0  # the last K stages (and the backbone's head) train; 0: all
    augment: bool = False  # random crops/flips (+ affine sketches, colour-jittered photos)
    workers: int = 0  # DataLoader processes decoding images; 0: the main one

    # -- the run
    cache_dir: str = ".cache/cdk-features"  # backbone features (and trunk activations)
    out: str = "runs/cdk"  # checkpoint.pt, metrics.json, plots, and the model bundle model/
    # the model bundle also holds int8 encoders, calibrated on training-class images and
    # checked on the validation classes (training.cdk.make_bundle); false: float32 only
    int8: bool = True
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    gallery_queries: int = 6  # gallery.png: query rows
    gallery_topk: int = 8  # gallery.png: photos per row
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
    # Section 4.2 and its appendix, and nothing else: frozen VGG16 features (512-d, pooled
    # conv5) as the heads' input, an MLP 8192 -> 512, mu 16, SGD 5e-3 with momentum 0.9 and
    # a cosine schedule, batch 4096, 10 epochs, uniform nesting weights, P@100; gradients
    # clipped at norm 1 as the published code does. None of the product's additions.
    "paper": {
        "modes": 512,
        "hidden": 8192,
        "batch_size": 4096,
        "epochs": 10,
        "lr": 5e-3,
        "weight_decay": 0.0,
        "nesting_weights": "uniform",
        "k": 100,
        "backbone": "vgg16",
        "pooling": "avg",
        "photo_flip_average": False,
        "input_dropout": 0.0,
        "instance_share": 0.0,
        "unit_embeddings": False,
        "raw_dims": 0,
        "sort_modes": False,
        "smooth_k": 0,
        "expand_n": 0,
        "hubness_weight": 0.0,
    },
}
DEFAULT_PRESET = "cpu"
# Why a preset, in one line each (printed before a run).
PRESET_REASONS = {
    "cpu": "the default: frozen EfficientNet-Lite1 features and the product's additions, "
           "chosen on validation classes; minutes on a CPU, seconds on a GPU",
    "paper": "the paper's setting (section 4.2): frozen VGG16 features, batch 4096, "
             "10 epochs; sized for the full Sketchy Extended data",
}


# Fewer optimiser steps than this in a whole run do not train the heads: the paper's
# setting makes ~140 on the full Sketchy Extended data (~60,000 training sketches in batches
# of 4096, 10 epochs), the cpu preset 800 on sketchy-mini's 2,350, the paper's setting 10
# there.
MIN_STEPS = 100


def fit_warnings(cfg: Config, sketches: int) -> list[str]:
    """One line per way ``cfg`` does not fit a training set of ``sketches`` sketches."""
    per_epoch = max(1, sketches // cfg.batch_size)
    if per_epoch * cfg.epochs >= MIN_STEPS:
        return []
    fix = "a smaller --batch-size or more --epochs" + (
        "" if cfg.preset == DEFAULT_PRESET else f", or --preset {DEFAULT_PRESET}")
    return [f"preset {cfg.preset} (batch {cfg.batch_size}, {cfg.epochs} epochs) does not fit "
            f"these data: {sketches} training sketches make {per_epoch} step(s) an epoch, "
            f"{per_epoch * cfg.epochs} in all (fewer than {MIN_STEPS} do not train the "
            f"heads); pass {fix}"]


def nesting_weights(cfg: Config):
    """The w_l of joint nesting for ``cfg``: (modes,) float64, or None (nesting_masks'
    uniform default)."""
    if cfg.nesting_weights == "harmonic":
        import torch  # local: keep config import light

        return 1.0 / torch.arange(1, cfg.modes + 1, dtype=torch.float64)
    return None


def smoothing(cfg: Config):
    """The gallery smoothing of ``cfg`` (training.cdk.model.smoothing.Smoothing)."""
    from .model.smoothing import Smoothing  # local: keep config import light

    return Smoothing(cfg.smooth_k, cfg.smooth_weight, cfg.smooth_rounds)


def hubness(cfg: Config):
    """The hubness correction of ``cfg`` (training.cdk.model.hubness.Hubness)."""
    from .model.hubness import Hubness  # local: keep config import light

    return Hubness(cfg.hubness_k, cfg.hubness_weight)


def expansion(cfg: Config):
    """The query expansion of ``cfg`` (training.cdk.model.smoothing.Expansion)."""
    from .model.smoothing import Expansion  # local: keep config import light

    return Expansion(cfg.expand_n, cfg.expand_weight)


def _check_choices(cfg: Config) -> None:
    from .model.backbones import BACKBONES, check_pooling  # local: keep config import light

    for name, choices in (("preset", tuple(PRESETS)), ("method", METHODS),
                          ("nesting_weights", NESTING_WEIGHTS), ("pairing", PAIRINGS),
                          ("backbone", tuple(sorted(BACKBONES)))):
        if getattr(cfg, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(cfg, name)!r}")
    if cfg.nesting_weights != "uniform" and cfg.method != "neuralsvd-jnt":
        raise ValueError(f"nesting_weights={cfg.nesting_weights!r} applies to neuralsvd-jnt "
                         f"only, not {cfg.method!r}")
    check_pooling(cfg.pooling)


def _check_finetune(cfg: Config) -> None:
    """What only frozen backbones have, and the flag to pass instead with --finetune."""
    frozen_only = {"photo_flip_average": "--photo-flip-average false (fine-tuning augments "
                                         "with flips)",
                   "sketch_flip_average": "--sketch-flip-average false",
                   "raw_dims": "--raw-dims 0"}
    for name, instead in frozen_only.items():
        if cfg.finetune and getattr(cfg, name):
            raise ValueError(f"{name} applies to frozen backbones; pass {instead} with "
                             "--finetune")
    if cfg.finetune:
        from .model.backbones import BACKBONES  # local: keep config import light

        count = BACKBONES[cfg.backbone].stage_count
        if cfg.trainable_stages > count:
            raise ValueError(f"trainable_stages must be <= {count} for {cfg.backbone}, "
                             f"got {cfg.trainable_stages}")


def _check_numbers(cfg: Config) -> None:
    if cfg.raw_dims and not cfg.unit_embeddings:
        raise ValueError("raw_dims weighs a cosine against the unit-length embeddings; it "
                         "needs --unit-embeddings true (or --raw-dims 0)")
    for name in ("trainable_stages", "workers", "image_size", "sketch_image_size", "raw_dims"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)!r}")
    for name in ("modes", "hidden", "epochs", "batch_size", "k"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)!r}")
    if cfg.batch_size < 2:
        raise ValueError(f"batch_size must be >= 2 (the CDK estimator), got {cfg.batch_size}")
    if not 0.0 <= cfg.instance_share <= 1.0:
        raise ValueError(f"instance_share must be in [0, 1], got {cfg.instance_share!r}")
    if not 0.0 <= cfg.raw_whiten <= 1.0:
        raise ValueError(f"raw_whiten must be in [0, 1], got {cfg.raw_whiten!r}")
    if not 0.0 <= cfg.input_dropout < 1.0:
        raise ValueError(f"input_dropout must be in [0, 1), got {cfg.input_dropout!r}")
    for name in ("lr", "mu", "raw_weight"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(cfg, name)!r}")
    smoothing(cfg)  # their own checks name the bad value
    expansion(cfg)
    hubness(cfg)
    if cfg.hubness_sample < 1:
        raise ValueError(f"hubness_sample must be >= 1, got {cfg.hubness_sample!r}")


def _check(cfg: Config) -> Config:
    _check_choices(cfg)
    _check_finetune(cfg)
    _check_numbers(cfg)
    if cfg.image_size == 0:  # resolved here, so every consumer and checkpoint sees the size
        from .model.backbones import BACKBONES

        cfg = dataclasses.replace(cfg, image_size=BACKBONES[cfg.backbone].native_size)
    if cfg.sketch_image_size == 0:
        cfg = dataclasses.replace(cfg, sketch_image_size=cfg.image_size)
    if cfg.finetune and cfg.sketch_image_size != cfg.image_size:
        raise ValueError(f"sketch_image_size {cfg.sketch_image_size} other than image_size "
                         f"{cfg.image_size} applies to frozen backbones; pass "
                         "--sketch-image-size 0 with --finetune")
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
        choices={"method": METHODS, "pairing": PAIRINGS, "nesting_weights": NESTING_WEIGHTS},
        required=("data",),
    )
    cfg = cli.parse(parser, make_config, argv)
    if not Path(cfg.data).is_dir():
        parser.error(f"--data {cfg.data!r} is not a folder")
    if cfg.split not in ("sketchy1", "sketchy2", "none") and not Path(cfg.split).is_file():
        parser.error(f"--split must be sketchy2, sketchy1, none or an existing FILE, got "
                     f"{cfg.split!r}")
    return cfg


def input_size(cfg: Config, modality: str) -> int:
    """The side ``modality``'s images are resized to: image_size for photos; for sketches
    sketch_image_size, or image_size where it is 0 (a config read from a checkpoint written
    before the field). The Embedder's ``size_of`` is the same rule on a checkpoint."""
    if modality == "sketch" and cfg.sketch_image_size:
        return cfg.sketch_image_size
    return cfg.image_size


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# Fields added after checkpoints were written without them: the value those were trained with.
# Query expansion changes no trained weight (a runtime field): older models get today's.
ADDED_LATER = {"instance_share": 0.0,  # the class kernel alone
               "raw_whiten": 0.0,  # plain PCA
               "sketch_image_size": 0,  # image_size
               "expand_n": Config.expand_n, "expand_weight": Config.expand_weight,
               "int8": Config.int8,
               # no sample of training sketches was written beside those models
               "hubness_weight": 0.0, "hubness_k": Config.hubness_k,
               "hubness_sample": Config.hubness_sample}


def from_dict(d: dict, source: str = "config") -> Config:
    """Rebuild the Config stored in a checkpoint (keys that are no field, such as
    ``untrained``, are ignored). A field in ADDED_LATER that is missing takes the value the
    code before it trained with; any other field missing means the file was written by
    other code: a ValueError naming ``source`` says to retrain."""
    names = [f.name for f in dataclasses.fields(Config)]
    d = {**ADDED_LATER, **d}
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(f"{source} lacks the config fields {missing[:6]}: it was written "
                         "by an earlier version of training.cdk; retrain it with "
                         "python -m training.cdk")
    return Config(**{n: d[n] for n in names})
