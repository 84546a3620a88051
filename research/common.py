"""What the research scripts share: the data folder argument, the features of a split's
non-test classes, the held-out class sets, a class-similarity pairing matrix, and training
the heads on frozen features through ``training.cdk.train`` with a pair sampler of the
experiment's own. Only the public API of ``training`` is used (names its modules export)."""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from training.cdk.config import Config
from training.cdk.data import Sampler, scan
from training.cdk.model.backbones import Backbone
from training.cdk.run import embed_features
from training.cdk.splits import class_folds, split_classes
from training.cdk.train import TrainData, TrainResult, train
from training.files import atomic_save

__all__ = ["DATA_ENV", "add_data_argument", "data_folder", "load_features", "folds_of",
           "similar_class_mixing", "train_heads", "embed"]

DATA_ENV = "SKETCHY_DATA"  # the sketch/photo folder when --data is not given
_CPU = torch.device("cpu")


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data DIR``, by default the folder that the environment variable SKETCHY_DATA
    names (read by ``data_folder``, so that modes that read no images need neither)."""
    parser.add_argument("--data", default=os.environ.get(DATA_ENV) or None, metavar="DIR",
                        help="the sketch/photo folder ({sketch,photo}/<class>/<file>, or the "
                             f"Sketchy Extended layout); default: ${DATA_ENV}")


def data_folder(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``args.data``, or the parser's error (exit 2) saying how to give it."""
    if not args.data:
        parser.error(f"no data folder: give --data DIR or set {DATA_ENV}=DIR")
    return args.data


# (files, modality) -> the features of those files: a (N, D) tensor or {view: (N, D)}
Extract = Callable[[Sequence[Path], str], object]


def _files_key(files: Sequence[Path], tag: str) -> str:
    h = hashlib.sha256(tag.encode())
    for f in files:
        st = Path(f).stat()
        h.update(f"{Path(f).resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_features(data: str, split: str, extract: Extract, *, pairs: bool = False,
                  cache: Path | None = None, tag: str = "") -> dict:
    """The features of ``split``'s non-test classes of ``data`` (no test-class image is
    read): {"classes": those classes (sorted), "all_classes": every class of ``data``,
    "sketch_labels" (Ns,), "photo_labels" (Np,): int64 indices into "classes", "photo_of":
    (Ns,) the photo row each sketch was drawn from (``pairs``; else None), "sketch":
    extract(sketch files, "sketch"), "photo": extract(photo files, "photo")}.

    cache: a file keeping "sketch" and "photo", used again while ``tag`` (what ``extract``
    computes) and the files (path, size, modification time) are the same."""
    ds = scan(data)
    parts = split_classes(split, list(ds.classes))
    seen = ds.restrict(parts["train"] + parts["valid"])
    out = {"classes": list(seen.classes), "all_classes": list(ds.classes),
           "sketch_labels": seen.sketch_labels, "photo_labels": seen.photo_labels,
           "photo_of": seen.instance_pairs() if pairs else None}
    key = _files_key([*seen.sketches, *seen.photos], tag) if cache is not None else ""
    if cache is not None and cache.is_file():
        stored = torch.load(cache, weights_only=True)
        if stored.get("key") == key:
            return {**out, "sketch": stored["sketch"], "photo": stored["photo"]}
    feats = {"sketch": extract(seen.sketches, "sketch"), "photo": extract(seen.photos, "photo")}
    if cache is not None:
        atomic_save({"key": key, **feats}, cache)
    return {**out, **feats}


def folds_of(classes: list[str], split: str, n: int, ids=None) -> list[tuple[str, dict]]:
    """[(name, {"train", "valid"})]: the split's own validation classes (n = 0: "valid"),
    or the class folds ``ids`` (default: all n) of its non-test classes
    (training.cdk.splits.class_folds), each held out in turn ("fold i/n"). ``classes``:
    every class of the data, test classes included (the split names those)."""
    parts = split_classes(split, classes)
    if n == 0:
        return [("valid", parts)]
    rest = parts["train"] + parts["valid"]
    folds = class_folds(rest, n)
    out = []
    for i in range(n) if ids is None else ids:
        held = set(folds[i])
        out.append((f"fold {i}/{n}", {"train": [c for c in rest if c not in held],
                                      "valid": folds[i]}))
    return out


def similar_class_mixing(feats: torch.Tensor, labels, alpha: float, tau: float) -> torch.Tensor:
    """(C, C) pairing matrix T = (1 - alpha) I + alpha W between C classes: W symmetric and
    doubly stochastic (Sinkhorn) with off-diagonal weights exp(cos(m_c, m_c') / tau) between
    the classes' mean features m_c (of the rows of ``feats`` (N, D) with class ``labels``
    (N,)), centred; W's diagonal is 0."""
    labels = torch.as_tensor(np.asarray(labels))
    C = int(labels.max()) + 1
    m = torch.stack([feats[labels == c].double().mean(0) for c in range(C)])
    m = torch.nn.functional.normalize(m - m.mean(0), dim=1)
    w = torch.exp((m @ m.T) / tau)
    w.fill_diagonal_(0.0)
    for _ in range(500):  # symmetric Sinkhorn: rows and columns to sum 1
        d = w.sum(1)
        w = w / torch.sqrt(d[:, None] * d[None, :])
    w = 0.5 * (w + w.T) / w.sum(1, keepdim=True)
    return (1 - alpha) * torch.eye(C, dtype=w.dtype) + alpha * w


def train_heads(cfg: Config, sketch_feats: torch.Tensor, photo_feats: torch.Tensor,
                sampler: Sampler) -> tuple[TrainResult, float]:
    """training.cdk.train on frozen features, sketch (Ns, D) and photo (Np, D), with pairs
    drawn from ``sampler`` (over those rows): training's own loop, seeds, input dropout,
    optimiser, schedule, spectrum pass and, with cfg.sort_modes, the modes sorted by the
    quotients of the sampler's kernel. The checkpoint is not kept. Returns (the result,
    seconds)."""
    n = (len(sketch_feats), len(photo_feats))
    # labels: only the default sampler reads them, and a sampler is always given here
    data = TrainData(sketch_feats, photo_feats, np.zeros(n[0], np.int64),
                     np.zeros(n[1], np.int64))
    backbone = Backbone("features", torch.nn.Identity(), sketch_feats.shape[1], (0.0,) * 3,
                        (1.0,) * 3)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = train(cfg, data, backbone, tmp, device="cpu", sampler=sampler)
    return res, time.perf_counter() - t0


def embed(head, x: torch.Tensor) -> torch.Tensor:
    """(N, modes) a head's outputs on features x (N, D), on the CPU."""
    return embed_features(head, x, _CPU)
