"""Sketch/photo data: folder scanning, class subsets and the paired sampler.

Layouts read by ``scan``:
* paired folder: ROOT/sketch/<class>/<file>, ROOT/photo/<class>/<file> (sketchy-mini);
* official Sketchy Extended: ROOT/sketch/tx_000000000000/<class>/..., ROOT/photo/
  tx_000000000000/<class>/... plus the extended photos in ROOT/extended_photo/<class>/ or
  ROOT/EXTEND_image_sketchy/<class>/ when present.
A sketch named ``<photo_id>-<n>.<ext>`` was drawn from photo ``<photo_id>``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .images import DataError

__all__ = ["DataError", "Dataset", "scan", "PairSampler"]

log = logging.getLogger(__name__)

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
OFFICIAL_SUBDIR = "tx_000000000000"
EXTENDED_PHOTO_DIRS = ("extended_photo", "EXTEND_image_sketchy")


@dataclass(frozen=True)
class Dataset:
    """Files and integer labels (indices into ``classes``) of both modalities."""

    root: Path
    classes: tuple[str, ...]
    sketches: tuple[Path, ...]
    sketch_labels: np.ndarray  # (Ns,) int64
    photos: tuple[Path, ...]
    photo_labels: np.ndarray  # (Np,) int64

    def restrict(self, classes: list[str]) -> Dataset:
        """The subset of ``classes`` (sorted, relabelled 0..len-1)."""
        unknown = sorted(set(classes) - set(self.classes))
        if unknown:
            raise ValueError(f"classes not in {str(self.root)!r}: {unknown}")
        keep = sorted(classes)
        new = {c: i for i, c in enumerate(keep)}
        old = [new.get(c, -1) for c in self.classes]

        def pick(files, labels):
            mapped = np.array([old[i] for i in labels], dtype=np.int64)
            sel = np.flatnonzero(mapped >= 0)
            return tuple(files[i] for i in sel), mapped[sel]

        s, sl = pick(self.sketches, self.sketch_labels)
        p, pl = pick(self.photos, self.photo_labels)
        return Dataset(self.root, tuple(keep), s, sl, p, pl)

    def instance_pairs(self) -> np.ndarray:
        """(Ns,) index of the photo each sketch was drawn from (file-name prefix match)."""
        by_stem = {(int(lab), p.stem): i for i, (p, lab) in
                   enumerate(zip(self.photos, self.photo_labels, strict=True))}
        out = np.empty(len(self.sketches), dtype=np.int64)
        for i, (s, lab) in enumerate(zip(self.sketches, self.sketch_labels, strict=True)):
            stem = s.stem.rsplit("-", 1)[0]
            j = by_stem.get((int(lab), stem))
            if j is None:
                raise DataError(
                    f"sketch {str(s)!r}: no photo {stem!r} in class {self.classes[lab]!r} "
                    "for instance pairing"
                )
            out[i] = j
        return out


def _list_images(class_dir: Path) -> list[Path]:
    files = []
    for p in sorted(class_dir.iterdir()):
        if p.name.startswith("."):
            continue  # hidden files (.DS_Store, editor swap files) are not data
        if p.is_dir() or p.suffix.lower() not in IMAGE_EXTS:
            raise DataError(f"unexpected entry {str(p)!r}: expected image files "
                            f"({sorted(IMAGE_EXTS)}) in class folders")
        files.append(p)
    return files


def _class_dirs(root: Path) -> dict[str, Path]:
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")}


def scan(root: str | Path) -> Dataset:
    """Read a dataset folder; DataError names an empty class or one-modality class."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data folder {str(root)!r} does not exist")
    sk_root, ph_root = root / "sketch", root / "photo"
    for d in (sk_root, ph_root):
        if not d.is_dir():
            raise DataError(f"data folder {str(root)!r} has no {d.name}/ subfolder")
    photo_roots = [ph_root]
    if (sk_root / OFFICIAL_SUBDIR).is_dir():  # official Sketchy Extended layout
        sk_root = sk_root / OFFICIAL_SUBDIR
        photo_roots = [ph_root / OFFICIAL_SUBDIR] if (ph_root / OFFICIAL_SUBDIR).is_dir() else []
        photo_roots += [root / d for d in EXTENDED_PHOTO_DIRS if (root / d).is_dir()]
        log.info("Sketchy Extended layout: sketches %s, photos %s", sk_root, photo_roots)
    sk_classes = _class_dirs(sk_root)
    ph_classes: dict[str, list[Path]] = {}
    for pr in photo_roots:
        for c, d in _class_dirs(pr).items():
            ph_classes.setdefault(c, []).append(d)
    only_s = sorted(set(sk_classes) - set(ph_classes))
    only_p = sorted(set(ph_classes) - set(sk_classes))
    if only_s or only_p:
        where = [f"{sk_root / c} has no photo class" for c in only_s]
        where += [f"{ph_classes[c][0]} has no sketch class" for c in only_p]
        raise DataError("classes present in one modality only: " + "; ".join(where[:5]))
    classes = sorted(sk_classes)
    if not classes:
        raise DataError(f"no class folders under {str(sk_root)!r}")
    sketches, sl, photos, pl = [], [], [], []
    for i, c in enumerate(classes):
        s = _list_images(sk_classes[c])
        p = [f for d in ph_classes[c] for f in _list_images(d)]
        if not s:
            raise DataError(f"empty class: no sketches in {str(sk_classes[c])!r}")
        if not p:
            raise DataError(f"empty class: no photos in {[str(d) for d in ph_classes[c]]}")
        sketches += s
        photos += p
        sl += [i] * len(s)
        pl += [i] * len(p)
    return Dataset(root, tuple(classes), tuple(sketches), np.array(sl, dtype=np.int64),
                   tuple(photos), np.array(pl, dtype=np.int64))


class PairSampler:
    """Minibatches of (sketch index, photo index) pairs drawn from p(x, y).

    pairing "class": p(x, y) = E_c[p(x|c) p(y|c)]. Each epoch visits every sketch once in
    random order (so p(c) is the empirical sketch class distribution) and pairs it with a
    photo drawn uniformly from its class, independently of the sketch.
    pairing "instance": each sketch with the photo it was drawn from (``photo_of``).
    Batches depend only on (seed, epoch), so every DDP rank draws the same global batch and
    a resumed run continues exactly.
    """

    def __init__(self, sketch_labels, photo_labels, pairing: str = "class", photo_of=None):
        self.sketch_labels = torch.as_tensor(np.asarray(sketch_labels), dtype=torch.long)
        photo_labels = torch.as_tensor(np.asarray(photo_labels), dtype=torch.long)
        if pairing not in ("class", "instance"):
            raise ValueError(f"pairing must be 'class' or 'instance', got {pairing!r}")
        self.pairing = pairing
        if pairing == "instance":
            if photo_of is None:
                raise ValueError("instance pairing needs photo_of (Dataset.instance_pairs())")
            self.photo_of = torch.as_tensor(np.asarray(photo_of), dtype=torch.long)
            return
        n_cls = int(max(self.sketch_labels.max(), photo_labels.max())) + 1
        # Photos grouped by class: the photos of class c are order[start[c]:start[c]+count[c]].
        self.order = torch.argsort(photo_labels, stable=True)
        self.count = torch.bincount(photo_labels, minlength=n_cls)
        self.start = torch.cumsum(self.count, 0) - self.count
        empty = sorted(set(self.sketch_labels.tolist()) & set(
            torch.nonzero(self.count == 0).flatten().tolist()))
        if empty:
            raise DataError(f"sketch classes {empty} have no photos to pair with")

    def num_sketches(self) -> int:
        return len(self.sketch_labels)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.num_sketches() // batch_size)

    def epoch(self, seed: int, epoch: int, batch_size: int):
        """Yield (sketch_idx (B,), photo_idx (B,)); B = min(batch_size, #sketches)."""
        g = torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))
        n = self.num_sketches()
        perm = torch.randperm(n, generator=g)
        B = min(batch_size, n)
        for step in range(self.steps_per_epoch(batch_size)):
            s = perm[step * B : (step + 1) * B]
            if self.pairing == "instance":
                p = self.photo_of[s]
            else:
                c = self.sketch_labels[s]
                u = torch.rand(len(s), generator=g, dtype=torch.float64)
                k = (u * self.count[c]).long().clamp_max(self.count[c] - 1)
                p = self.order[self.start[c] + k]
            yield s, p
