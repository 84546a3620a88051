"""Labelled sketch/photo files, class subsets and the paired sampler.

The files come from ``training.folders`` (paired and Sketchy Extended layouts). A sketch
named ``<photo_id>-<n>.<ext>`` was drawn from photo ``<photo_id>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.folders import DataError, scan_paired

__all__ = ["DataError", "Dataset", "scan", "PairSampler"]


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


def scan(root: str | Path) -> Dataset:
    """Read a paired or Sketchy Extended folder; DataError names an empty class, a class with
    one modality only, or a stray file."""
    sketches, photos = scan_paired(root)
    classes = tuple(sketches)  # sorted, the same on both sides

    def flat(by_class):
        files = [f for c in classes for f in by_class[c]]
        labels = np.array([i for i, c in enumerate(classes) for _ in by_class[c]], dtype=np.int64)
        return tuple(files), labels

    return Dataset(Path(root), classes, *flat(sketches), *flat(photos))


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
        self.photo_labels = photo_labels
        if pairing not in ("class", "instance"):
            raise ValueError(f"pairing must be 'class' or 'instance', got {pairing!r}")
        self.pairing = pairing
        if pairing == "instance":
            if photo_of is None:
                raise ValueError("instance pairing needs photo_of (Dataset.instance_pairs())")
            self.photo_of = torch.as_tensor(np.asarray(photo_of), dtype=torch.long)
            if len(self.photo_of) != len(self.sketch_labels) or (
                    len(self.photo_of) and not 0 <= int(self.photo_of.min())
                    <= int(self.photo_of.max()) < len(photo_labels)):
                raise ValueError(f"photo_of must give each of the {len(self.sketch_labels)} "
                                 f"sketches a photo index in [0, {len(photo_labels)})")
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

    @torch.no_grad()
    def joint_moment(self, f: torch.Tensor, g: torch.Tensor, sketch_idx=None, photo_idx=None
                     ) -> torch.Tensor:
        """E_p(x,y)[f(X) g(Y)] (L,) under the distribution the batches are drawn from, given
        f: (S, L) at the sketches ``sketch_idx`` and g: (P, L) at the photos ``photo_idx``
        (None: all of them, in order). Class pairing: the mean over the sketches of f times
        the mean of g over the photos of the sketch's class; instance pairing: the mean of
        f(sketch) g(its photo). With subsets, sketches whose class (or photo) is not among
        the given photos are left out; none left is an error."""
        s_idx = torch.arange(len(f)) if sketch_idx is None else torch.as_tensor(sketch_idx)
        p_idx = torch.arange(len(g)) if photo_idx is None else torch.as_tensor(photo_idx)
        if len(s_idx) != len(f) or len(p_idx) != len(g):
            raise ValueError(f"{len(f)} sketch rows for {len(s_idx)} indices, "
                             f"{len(g)} photo rows for {len(p_idx)} indices")
        f, g = f.double(), g.double()
        if self.pairing == "instance":
            # position of each photo among the given rows, -1 where absent; sized by every
            # photo of the set, not only those some sketch was drawn from
            row = torch.full((len(self.photo_labels),), -1, dtype=torch.long)
            row[p_idx.long()] = torch.arange(len(p_idx))
            partner = row[self.photo_of[s_idx.long()]]
            keep = partner >= 0
            pairs = f[keep] * g[partner[keep]]
        else:
            g_bar, n = self.class_means(g, p_idx)
            c = self.sketch_labels[s_idx.long()]
            keep = n[c] > 0
            pairs = f[keep] * g_bar[c[keep]]
        if len(pairs) == 0:
            raise ValueError("no sketch among the given rows has its pair among the photos")
        return pairs.mean(0)

    @torch.no_grad()
    def photo_marginal(self, sketch_idx=None, photo_idx=None) -> torch.Tensor:
        """(P,) float64 p(y) at the photos ``photo_idx`` (None: all, in order), summing to 1:
        how often the batches draw each photo, for the distribution ``joint_moment`` reads
        on the given rows (its sketches ``sketch_idx``, each as likely, paired among the
        given photos). Class pairing: a sketch of class c puts 1 / #photos of c on each of
        them; instance pairing: 1 on the photo it was drawn from, so a photo with three
        sketches is drawn three times as often as one with one, and one with none never."""
        s_idx = (torch.arange(len(self.sketch_labels)) if sketch_idx is None
                 else torch.as_tensor(sketch_idx).long())
        p_idx = (torch.arange(len(self.photo_labels)) if photo_idx is None
                 else torch.as_tensor(photo_idx).long())
        if self.pairing == "instance":
            row = torch.full((len(self.photo_labels),), -1, dtype=torch.long)
            row[p_idx] = torch.arange(len(p_idx))
            partner = row[self.photo_of[s_idx]]
            w = torch.bincount(partner[partner >= 0], minlength=len(p_idx)).double()
        else:
            labels = self.photo_labels[p_idx]
            n = torch.bincount(labels, minlength=len(self.count)).double()
            sketches = torch.bincount(self.sketch_labels[s_idx], minlength=len(n)).double()
            w = (sketches * (n > 0))[labels] / n[labels]
        if float(w.sum()) == 0:
            raise ValueError("no sketch among the given rows has its pair among the photos")
        return w / w.sum()

    def halves(self, sketch_idx=None, photo_idx=None):
        """The given rows (None: all, in order) cut in two halves A and B of the same
        distribution, for a held-out check of an estimate: [(sketch_pos_A, photo_pos_A),
        (sketch_pos_B, photo_pos_B)], positions within the given rows. Photos alternate
        between the halves in their order within each class; a sketch goes with its
        class's alternation (class pairing) or with its photo (instance pairing), so each
        half keeps its pairs."""
        s_idx = (torch.arange(len(self.sketch_labels)) if sketch_idx is None
                 else torch.as_tensor(sketch_idx).long())
        p_idx = (torch.arange(len(self.photo_labels)) if photo_idx is None
                 else torch.as_tensor(photo_idx).long())
        p_half = _alternate(self.photo_labels[p_idx])
        if self.pairing == "instance":
            half_of = torch.full((len(self.photo_labels),), -1, dtype=torch.long)
            half_of[p_idx] = p_half
            s_half = half_of[self.photo_of[s_idx]]  # -1: its photo is not among the rows
        else:
            s_half = _alternate(self.sketch_labels[s_idx])
        return [(torch.nonzero(s_half == h).flatten(), torch.nonzero(p_half == h).flatten())
                for h in (0, 1)]

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
                p = self.photos_of_classes(self.sketch_labels[s], g)
            yield s, p

    def photos_of_classes(self, c: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """(B,) class labels -> (B,) photo indices, each drawn uniformly from its class."""
        u = torch.rand(len(c), generator=g, dtype=torch.float64)
        k = (u * self.count[c]).long().clamp_max(self.count[c] - 1)
        return self.order[self.start[c] + k]

    def class_means(self, g: torch.Tensor, p_idx: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """g: (P, L) at the photos ``p_idx`` -> ((C, L) float64 mean of g over each class's
        photos among them (0 where none), (C,) how many there are)."""
        labels = self.photo_labels[p_idx.long()]
        n = torch.bincount(labels, minlength=len(self.count)).double()
        g_bar = torch.zeros(len(n), g.shape[1], dtype=torch.float64).index_add_(
            0, labels, g.double())
        return g_bar / n.clamp_min(1)[:, None], n


def _alternate(labels: torch.Tensor) -> torch.Tensor:
    """(N,) class labels -> (N,) 0/1: the rank of each row within its class, modulo 2."""
    rank = torch.empty_like(labels)
    order = torch.argsort(labels, stable=True)
    sorted_labels = labels[order]
    first = torch.searchsorted(sorted_labels, sorted_labels)  # where each class starts
    rank[order] = torch.arange(len(labels)) - first
    return rank % 2
