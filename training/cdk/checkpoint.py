"""CDK checkpoints: one self-describing file with everything needed to embed later.

Layout (a dict saved with torch.save)::

    format: "sketchsvd-cdk", version: 2
    config: Config as a dict (how it was built; loaders need no flags)
    backbone: {name, feature_dim, image_size, sketch_image_size, mean, std, finetuned,
               photo_flip_average, sketch_flip_average, pooling} (sketch_image_size: the
               side sketches are embedded at; absent in older files: image_size)
    backbones: {"sketch": state_dict, "photo": state_dict}   (shared storage if frozen)
    heads: {"sketch": state_dict, "photo": state_dict}, head_arch: {in_dim, hidden, modes, mu}
    singular_values: (modes,) float32, the CDK's Rayleigh quotients at the learned pairs
    singular_values_norm: (modes,) float32 sqrt(E f^2 E g^2), or None
    raw: {mean: {"sketch": (D,), "photo": (D,)}, axes: (D, p), weight} of the raw coordinates
        appended to the embedding (model.RawProjection), or None: none
    trained: bool; epoch: int
    train_state: optimizer/scheduler state for resuming (None when finished or untrained)
    history: per-epoch log

There is one format version; a file of another version is refused with a message that
says to retrain it.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch
from torch import nn

from training.files import atomic_save

from .model.backbones import Backbone
from .model.heads import MODALITIES, Head, RawProjection

__all__ = ["FORMAT", "HUBNESS_SAMPLE", "VERSION", "save_checkpoint", "read_checkpoint",
           "load_checkpoint"]

FORMAT = "sketchsvd-cdk"
VERSION = 2
# Beside the checkpoint: the training sketches' embeddings (S, width) the hubness correction
# scores each stored photo against, with its k and weight (model.hubness); the model bundle
# carries them
HUBNESS_SAMPLE = "hubness_sample.pt"


def save_checkpoint(
    path: str | Path,
    *,
    config: dict,
    backbone: Backbone,
    image_size: int,
    backbones: dict[str, nn.Module],
    heads: dict[str, Head],
    singular_values: torch.Tensor,
    trained: bool,
    epoch: int,
    finetuned: bool = False,
    train_state: dict | None = None,
    history: list | None = None,
    singular_values_norm: torch.Tensor | None = None,
    raw: dict[str, RawProjection] | None = None,
) -> Path:
    """Write a CDK checkpoint atomically. backbones / heads: one module per modality
    ("sketch", "photo"); the same module object for both is stored once. Each modality's
    mirror averaging is the config's ``photo_flip_average`` / ``sketch_flip_average``, the
    sketches' input side its ``sketch_image_size`` (0 or absent: ``image_size``)."""
    for name, d in (("backbones", backbones), ("heads", heads)):
        if set(d) != set(MODALITIES):
            raise ValueError(f"{name} must have keys {MODALITIES}, got {sorted(d)}")
    sv = torch.as_tensor(singular_values, dtype=torch.float32).detach().cpu()
    modes = heads["sketch"].modes
    if sv.shape != (modes,) or not bool(torch.isfinite(sv).all()):
        raise ValueError(f"singular_values must be finite of shape ({modes},), got {sv}")

    def cpu_state(m: nn.Module) -> dict:
        return {k: v.detach().cpu() for k, v in m.state_dict().items()}

    bb_state = {mod: cpu_state(backbones[mod]) for mod in MODALITIES}
    if backbones["sketch"] is backbones["photo"]:
        bb_state["photo"] = bb_state["sketch"]  # same tensors: torch.save writes them once
    obj = {
        "format": FORMAT,
        "version": VERSION,
        "config": dict(config),
        "backbone": {
            "name": backbone.name,
            "feature_dim": backbone.feature_dim,
            "image_size": int(image_size),
            "sketch_image_size": int(config.get("sketch_image_size") or image_size),
            "mean": list(backbone.mean),
            "std": list(backbone.std),
            "finetuned": bool(finetuned),
            "photo_flip_average": bool(config["photo_flip_average"]),
            "sketch_flip_average": bool(config["sketch_flip_average"]),
            "pooling": backbone.pooling,
        },
        "backbones": bb_state,
        "heads": {mod: cpu_state(heads[mod]) for mod in MODALITIES},
        "head_arch": heads["sketch"].arch(),
        "singular_values": sv,
        "singular_values_norm": None if singular_values_norm is None else torch.as_tensor(
            singular_values_norm, dtype=torch.float32).detach().cpu(),
        "raw": None if raw is None else {
            "mean": {mod: raw[mod].mean.detach().cpu() for mod in MODALITIES},
            "axes": raw["sketch"].axes.detach().cpu(), "weight": raw["sketch"].weight},
        "trained": bool(trained),
        "epoch": int(epoch),
        "train_state": train_state,
        "history": list(history or []),
    }
    return atomic_save(obj, path)


# What the embedder reads, as {key: nested keys}; train_state, history, epoch are optional.
REQUIRED = {
    "config": (),
    "backbone": ("name", "image_size", "mean", "std", "finetuned", "photo_flip_average",
                 "sketch_flip_average", "pooling"),
    "backbones": MODALITIES,
    "heads": MODALITIES,
    "head_arch": ("in_dim", "hidden", "modes", "mu"),
    "singular_values": (),
    "raw": (),
    "trained": (),
}


def read_checkpoint(path: str | Path, map_location="cpu") -> tuple[dict, str]:
    """(checkpoint dict, sha256 of its bytes), validated; ValueError names a file that is not
    a complete CDK checkpoint.

    The file is read once and both loaded and hashed from those bytes, so the hash names
    exactly what was loaded even if the file is replaced meanwhile. Only tensors and plain
    values are unpickled (weights_only=True): a crafted file cannot run code.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    data = path.read_bytes()
    try:
        obj = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{str(path)!r} is not a sketchsvd CDK checkpoint: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a sketchsvd CDK checkpoint (no format tag)")
    if obj.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} has checkpoint version {obj.get('version')!r}, "
                         f"this code reads version {VERSION}: it was written by other code; "
                         "retrain it with python -m training.cdk")
    missing = [k for k in REQUIRED if k not in obj]
    missing += [f"{k}.{sub}" for k, subs in REQUIRED.items() if k in obj for sub in subs
                if not isinstance(obj[k], dict) or sub not in obj[k]]
    if missing:
        raise ValueError(f"{str(path)!r} is an incomplete CDK checkpoint: it lacks "
                         f"{', '.join(missing)}; train or export it again")
    return obj, hashlib.sha256(data).hexdigest()


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load and validate a CDK checkpoint dict; ValueError names a file that is not one."""
    return read_checkpoint(path, map_location)[0]
