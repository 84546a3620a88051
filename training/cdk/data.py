"""Labelled sketch/photo files, class subsets and the paired sampler.

The files come from ``training.folders`` (paired and Sketchy Extended layouts). A sketch
named ``<photo_id>-<n>.<ext>`` was drawn from photo ``<photo_id>``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from training.folders import DataError, scan_paired

__all__ = ["DataError", "Dataset", "scan", "Sampler", "PairSampler", "rank_in_class"]


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


@runtime_checkable
class Sampler(Protocol):
    """The pair distribution p(x, y) on the training rows that ``training.cdk.train.train``
    learns the CDK of: it draws the batches and gives the expectations its spectrum pass
    (``training.cdk.spectrum``) reads. PairSampler (the config's pairing) is the product's;
    an experiment passes its own. Every sketch index is a row of the training sketches,
    every photo index a row of the training photos; ``sketch_idx``/``photo_idx`` None means
    all rows, in order.

    The fine-tuning path's spectrum pass embeds a seeded subset of the photos; a sampler
    with an ``instance_share`` > 0 and ``photo_of`` (N_s,) (as PairSampler has) gets each
    sampled sketch's own photo added to it.
    """

    def steps_per_epoch(self, batch_size: int) -> int:
        """Optimiser steps in one epoch of batches of ``batch_size`` pairs."""
        ...

    def epoch(self, seed: int, epoch: int, batch_size: int
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(sketch idx (B,), photo idx (B,)) per step, ``steps_per_epoch`` of them; a
        function of (seed, epoch) alone, so that a resumed run and every DDP rank draw the
        same batches."""
        ...

    def joint_moment(self, f: torch.Tensor, g: torch.Tensor, sketch_idx=None, photo_idx=None
                     ) -> torch.Tensor:
        """E_p(x,y)[f(X) g(Y)] (L,) float64 from f: (S, L) at ``sketch_idx`` and g: (P, L)
        at ``photo_idx``, under p restricted to those rows."""
        ...

    def photo_marginal(self, sketch_idx=None, photo_idx=None) -> torch.Tensor:
        """(P,) float64 p(y) at ``photo_idx`` (summing to 1) under p restricted to the given
        rows: how often the batches draw each photo."""
        ...

    def halves(self, sketch_idx=None, photo_idx=None
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The given rows cut in two halves A and B of the same distribution, each as
        (sketch positions, photo positions) within the given rows: the held-out check of
        the modes' order (metrics.heldout_order) estimates on each."""
        ...


class PairSampler:
    """Minibatches of (sketch index, photo index) pairs drawn from p(x, y).

    pairing "class": p(x, y) = E_c[p(x|c) p(y|c)]. Each epoch visits every sketch once in
    random order (so p(c) is the empirical sketch class distribution) and pairs it with a
    photo drawn uniformly from its class, independently of the sketch. With
    ``instance_share`` a > 0 the pair is instead, with probability a, the sketch and the
    photo it was drawn from (``photo_of``): p = (1 - a) p_class + a p_instance, a kernel whose
    rank is no longer capped at the number of classes less one.
    pairing "instance": each sketch with the photo it was drawn from (a = 1).
    Batches depend only on (seed, epoch), so every DDP rank draws the same global batch and
    a resumed run continues exactly; a = 0 draws exactly what the class pairing drew.
    """

    def __init__(self, sketch_labels, photo_labels, pairing: str = "class", photo_of=None,
                 instance_share: float = 0.0):
        self.sketch_labels = torch.as_tensor(np.asarray(sketch_labels), dtype=torch.long)
        photo_labels = torch.as_tensor(np.asarray(photo_labels), dtype=torch.long)
        self.photo_labels = photo_labels
        if pairing not in ("class", "instance"):
            raise ValueError(f"pairing must be 'class' or 'instance', got {pairing!r}")
        if not 0.0 <= float(instance_share) <= 1.0:
            raise ValueError(f"instance_share must be in [0, 1], got {instance_share!r}")
        self.pairing = pairing
        self.instance_share = 1.0 if pairing == "instance" else float(instance_share)
        if self.instance_share > 0:
            if photo_of is None:
                raise ValueError(f"pairing {pairing!r} with instance_share "
                                 f"{self.instance_share:g} needs photo_of "
                                 "(Dataset.instance_pairs()); instance_share 0 pairs within "
                                 "classes alone")
            self.photo_of = torch.as_tensor(np.asarray(photo_of), dtype=torch.long)
            if len(self.photo_of) != len(self.sketch_labels) or (
                    len(self.photo_of) and not 0 <= int(self.photo_of.min())
                    <= int(self.photo_of.max()) < len(photo_labels)):
                raise ValueError(f"photo_of must give each of the {len(self.sketch_labels)} "
                                 f"sketches a photo index in [0, {len(photo_labels)})")
        if self.instance_share == 1.0:
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

    def _rows(self, sketch_idx, photo_idx) -> tuple[torch.Tensor, torch.Tensor]:
        s_idx = (torch.arange(len(self.sketch_labels)) if sketch_idx is None
                 else torch.as_tensor(sketch_idx).long())
        p_idx = (torch.arange(len(self.photo_labels)) if photo_idx is None
                 else torch.as_tensor(photo_idx).long())
        return s_idx, p_idx

    def _partners(self, s_idx: torch.Tensor, p_idx: torch.Tensor) -> torch.Tensor:
        """(S,) the position among the photo rows of each sketch's own photo, -1 where it
        is not among them."""
        row = torch.full((len(self.photo_labels),), -1, dtype=torch.long)
        row[p_idx] = torch.arange(len(p_idx))
        return row[self.photo_of[s_idx]]

    def _conditional(self, s_idx: torch.Tensor, p_idx: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """p(y | x) on the given rows as (keep (S,) bool: the sketches with some partner
        among the photos, class share (S,), class photo counts (C,), partner positions
        (S,) or None): a kept sketch of class c puts class_share / n_c on each of its
        class's photos among the rows (n_c of them) and 1 - class_share on its own photo.
        A sketch whose own photo is not among the rows pairs within its class only."""
        a = self.instance_share
        partner = self._partners(s_idx, p_idx) if a > 0 else None
        if a == 1.0:
            keep = partner >= 0
            return keep, torch.zeros(len(s_idx), dtype=torch.float64), None, partner
        c = self.sketch_labels[s_idx]
        n = torch.bincount(self.photo_labels[p_idx], minlength=len(self.count)).double()
        share = torch.full((len(s_idx),), 1.0 - a, dtype=torch.float64)
        if partner is not None:
            share[partner < 0] = 1.0
        keep = n[c] > 0
        return keep, share, n, partner

    @torch.no_grad()
    def joint_moment(self, f: torch.Tensor, g: torch.Tensor, sketch_idx=None, photo_idx=None
                     ) -> torch.Tensor:
        """E_p(x,y)[f(X) g(Y)] (L,) under the distribution the batches are drawn from, given
        f: (S, L) at the sketches ``sketch_idx`` and g: (P, L) at the photos ``photo_idx``
        (None: all of them, in order): the mean over the sketches of f times the mean of g
        under the sketch's p(y | x): its class's photos' mean (class pairing), its own
        photo (instance pairing), or their mixture. With subsets, sketches with no partner
        among the given photos are left out; none left is an error."""
        s_idx, p_idx = self._rows(sketch_idx, photo_idx)
        if len(s_idx) != len(f) or len(p_idx) != len(g):
            raise ValueError(f"{len(f)} sketch rows for {len(s_idx)} indices, "
                             f"{len(g)} photo rows for {len(p_idx)} indices")
        f, g = f.double(), g.double()
        keep, share, _, partner = self._conditional(s_idx, p_idx)
        partnered = torch.zeros_like(f)
        if partner is not None:
            ok = partner >= 0
            partnered[ok] = (1.0 - share[ok, None]) * g[partner[ok]]
        if self.instance_share < 1.0:
            g_bar, _ = self.class_means(g, p_idx)
            partnered += share[:, None] * g_bar[self.sketch_labels[s_idx]]
        if not bool(keep.any()):
            raise ValueError("no sketch among the given rows has its pair among the photos")
        return (f[keep] * partnered[keep]).mean(0)

    @torch.no_grad()
    def photo_marginal(self, sketch_idx=None, photo_idx=None) -> torch.Tensor:
        """(P,) float64 p(y) at the photos ``photo_idx`` (None: all, in order), summing to 1:
        how often the batches draw each photo, for the distribution ``joint_moment`` reads
        on the given rows (its sketches ``sketch_idx``, each as likely, paired among the
        given photos). Class pairing: a sketch of class c puts 1 / #photos of c on each of
        them; instance pairing: 1 on the photo it was drawn from, so a photo with three
        sketches is drawn three times as often as one with one, and one with none never;
        the mixture: both, by their shares."""
        s_idx, p_idx = self._rows(sketch_idx, photo_idx)
        keep, share, n, partner = self._conditional(s_idx, p_idx)
        w = torch.zeros(len(p_idx), dtype=torch.float64)
        if partner is not None:
            ok = keep & (partner >= 0)
            w.index_add_(0, partner[ok], 1.0 - share[ok])
        if self.instance_share < 1.0:
            labels = self.photo_labels[p_idx]
            per_class = torch.zeros(len(n), dtype=torch.float64).index_add_(
                0, self.sketch_labels[s_idx][keep], share[keep])
            w += per_class[labels] / n[labels]
        if float(w.sum()) == 0:
            raise ValueError("no sketch among the given rows has its pair among the photos")
        return w / w.sum()

    def halves(self, sketch_idx=None, photo_idx=None):
        """The given rows (None: all, in order) cut in two halves A and B of the same
        distribution, for a held-out check of an estimate: [(sketch_pos_A, photo_pos_A),
        (sketch_pos_B, photo_pos_B)], positions within the given rows. Photos alternate
        between the halves in their order within each class; a sketch goes with its
        class's alternation (class pairing) or with its photo (instance pairs, where that
        photo is among the rows), so each half keeps its pairs."""
        s_idx, p_idx = self._rows(sketch_idx, photo_idx)
        p_half = _alternate(self.photo_labels[p_idx])
        if self.instance_share == 1.0:
            s_half = torch.full((len(s_idx),), -1, dtype=torch.long)  # -1: photo not there
        else:
            s_half = _alternate(self.sketch_labels[s_idx])
        if self.instance_share > 0:
            partner = self._partners(s_idx, p_idx)
            s_half[partner >= 0] = p_half[partner[partner >= 0]]
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
            if self.instance_share == 1.0:
                p = self.photo_of[s]
            else:
                p = self.photos_of_classes(self.sketch_labels[s], g)
                if self.instance_share > 0:  # drawn after the class draw: a = 0 as before
                    own = torch.rand(len(s), generator=g, dtype=torch.float64)
                    p = torch.where(own < self.instance_share, self.photo_of[s], p)
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


def rank_in_class(labels: torch.Tensor) -> torch.Tensor:
    """(N,) class labels -> (N,) the rank of each row among the rows of its class, in row
    order (0 for the first)."""
    rank = torch.empty_like(labels)
    order = torch.argsort(labels, stable=True)
    sorted_labels = labels[order]
    first = torch.searchsorted(sorted_labels, sorted_labels)  # where each class starts
    rank[order] = torch.arange(len(labels)) - first
    return rank


def _alternate(labels: torch.Tensor) -> torch.Tensor:
    """(N,) class labels -> (N,) 0/1: the rank of each row within its class, modulo 2."""
    return rank_in_class(labels) % 2
