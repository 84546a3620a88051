"""Gallery smoothing: each photo embedding moves toward the mean of its nearest gallery
neighbours (database-side augmentation), a few rounds.

    g <- (g + weight * mean_{j in kNN(g)} g_j) / (1 + weight)
                                   (rounds times; kNN by cosine, self excluded)

Photos of one class lie near each other in the photo embedding space even for classes the
heads never saw, so averaging with neighbours pulls each photo toward its class and away
from the photos of other classes that a sketch confuses it with. The rule is a convex
combination of embeddings (scores keep their scale) that acts on every coordinate alike, so
coordinate i still holds mode i and the first d coordinates of a smoothed embedding are its
d-mode prefix. It costs nothing per query: the index stores the smoothed vectors. It
serves class-level retrieval; instance-level retrieval (``--pairing instance``) wants the
exact photo back and should not smooth (``--smooth-k 0``).

``smooth`` takes the neighbour search as an argument: exact search in torch here (training's
evaluation), FAISS in ``index.build`` (tested to give the same neighbours).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Smoothing", "exact_neighbours", "smooth"]

# (N, d) vectors, k, rows (R,) -> (R, k) int64 indices of the k rows of the N nearest to each
# of ``rows`` by cosine, the row itself excluded
Neighbours = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Smoothing:
    """k neighbours per photo (0: off), the neighbours' weight, and the rounds."""

    k: int = 10
    weight: float = 4.0
    rounds: int = 2

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"smoothing k must be an integer >= 0, got {self.k!r}")
        if not self.weight >= 0:
            raise ValueError(f"smoothing weight must be >= 0, got {self.weight!r}")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"smoothing rounds must be an integer >= 1, got {self.rounds!r}")

    @property
    def active(self) -> bool:
        return self.k > 0 and self.weight > 0

    def as_dict(self) -> dict:
        return {"k": self.k, "weight": self.weight, "rounds": self.rounds}


@torch.no_grad()
def exact_neighbours(g: torch.Tensor, k: int, rows: torch.Tensor, chunk: int = 4096
                     ) -> torch.Tensor:
    """(N, d), k, rows (R,) -> (R, k) indices of the k rows most cosine-similar to each of
    ``rows`` (itself excluded; ties by index), by brute force in chunks."""
    x = torch.nn.functional.normalize(g.double(), dim=1)
    out = []
    for i in range(0, len(rows), chunk):
        r = rows[i : i + chunk]
        s = x[r] @ x.T  # (c, N)
        s[torch.arange(len(r)), r] = -float("inf")  # never its own neighbour
        out.append(torch.sort(-s, dim=1, stable=True).indices[:, :k])
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.long)


@torch.no_grad()
def smooth(g: torch.Tensor, cfg: Smoothing, neighbours: Neighbours = exact_neighbours,
           rows=None) -> torch.Tensor:
    """(N, d) photo embeddings -> (N, d) smoothed ones (float32); unchanged when ``cfg`` is
    off or the gallery has no other photo to average with. ``rows``: smooth only these rows
    against the whole gallery, the others held fixed (photos added to a smoothed index)."""
    g = torch.as_tensor(g, dtype=torch.float32).clone()
    rows = torch.arange(len(g)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    k = min(cfg.k, len(g) - 1)
    if not cfg.active or k < 1 or len(rows) == 0:
        return g
    for _ in range(cfg.rounds):
        idx = neighbours(g, k, rows)  # (R, k)
        if idx.shape != (len(rows), k):
            raise ValueError(f"neighbour search returned {tuple(idx.shape)}, "
                             f"expected {(len(rows), k)}")
        g[rows] = (g[rows] + cfg.weight * g[idx].mean(1)) / (1 + cfg.weight)
    return g
