"""Gallery smoothing: each photo embedding moves toward the mean of its nearest gallery
neighbours (database-side augmentation), a few rounds; and query expansion: each query
moves toward the mean of the photos it retrieves first, and searches again.

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

Query expansion is the same averaging on the query side, at query time:

    f <- f + weight * mean_{j in top-n(f)} g_j       (top-n by inner product, once)

on the d-prefix a query scores with. A sketch's best photos are mostly of its class, and
they are photos: their mean carries what photos of that class share, which a sketch draws
only in part. It serves class-level retrieval alike (``--expand-n 0`` for instance-level).
Training's evaluation ranks the whole gallery by the expanded query (``expand_exact``: mAP
needs every rank). The service wants only the top k, and the expanded query's top k lie
among the query's own best few hundred, so it re-scores a pool of candidates the index
gives (``expanded_search``) instead of a second pass over the index.

``smooth`` takes the neighbour search as an argument: exact search in torch here (training's
evaluation), FAISS in ``index.build`` (tested to give the same neighbours).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RESCORE", "RESCORE_MIN", "Expansion", "Smoothing", "exact_neighbours", "expand",
           "expand_exact", "expand_with", "expanded_search", "smooth"]

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


@dataclass(frozen=True)
class Expansion:
    """Query expansion: the n best photos of the first search (0: off) and the weight of
    their mean against the query."""

    n: int = 5
    weight: float = 0.5

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"query expansion n must be an integer >= 0, got {self.n!r}")
        if not self.weight >= 0:
            raise ValueError(f"query expansion weight must be >= 0, got {self.weight!r}")

    @property
    def active(self) -> bool:
        return self.n > 0 and self.weight > 0

    def as_dict(self) -> dict:
        return {"n": self.n, "weight": self.weight}


def expand(queries: np.ndarray | torch.Tensor, top: np.ndarray | torch.Tensor,
           cfg: Expansion) -> np.ndarray | torch.Tensor:
    """(Q, d) queries and (Q, n', d) the vectors of each one's best n' <= cfg.n photos ->
    (Q, d) expanded queries (numpy or torch, as given; a query with no photo is kept)."""
    if top.shape[1] == 0:
        return queries
    return queries + cfg.weight * top.mean(1)


@torch.no_grad()
def expand_exact(f: torch.Tensor, g: torch.Tensor, cfg: Expansion) -> torch.Tensor:
    """(Q, d) queries expanded with their best photos in the gallery g (N, d), found by
    exact inner product (ties by index): what the service does over a flat index."""
    f = torch.as_tensor(f)
    g = torch.as_tensor(g).to(f.dtype)
    n = min(cfg.n, len(g))
    if not cfg.active or n < 1:
        return f
    top = torch.sort(-(f @ g.T), dim=1, stable=True).indices[:, :n]  # (Q, n)
    return expand(f, g[top], cfg)


def expand_with(queries: np.ndarray, search: Callable, vectors: Callable, cfg: Expansion
                ) -> np.ndarray:
    """(N, d) float32 queries expanded with their best photos in an index: ``search``
    (queries, n) -> (scores, rows (N, n'), -1 where none) finds them, ``vectors`` (rows, d)
    -> (M, D >= d) reads their stored vectors (the service's GalleryIndex.search and
    .vectors)."""
    if not cfg.active:
        return queries
    _, rows = search(queries, cfg.n)
    d = queries.shape[1]
    out = queries.copy()
    for i, r in enumerate(rows):
        top = vectors(r[r >= 0], d)[None, :, :d]  # (1, n'', d)
        out[i] = expand(queries[i : i + 1], top, cfg)[0]
    return out


# expanded_search's pool: at least max(RESCORE_MIN, RESCORE x k) photos (the service's
# default; its EXPAND_RESCORE setting)
RESCORE = 10
RESCORE_MIN = 100


def expanded_search(queries: np.ndarray, k: int, search: Callable, vectors: Callable,
                    pool: Callable, cfg: Expansion, rescore: int = RESCORE
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The top k photos of each (N, d) float32 query expanded by ``cfg``: (scores, rows),
    (N, k') each as ``search`` (queries, k) returns them (-1 rows where none).

    ``rescore`` > 0: ``pool`` (queries, K) -> (rows (N, K'), -1 where none; for each query
    its valid rows' vectors; the queries), vectors and queries in a basis where their inner
    products are the index's scores (the service's GalleryIndex.pool, index.kinds'
    Kind.pool), gives each query a pool of at least K = max(RESCORE_MIN, rescore x k)
    photos. Its best n by the query expand the query, and the expanded query re-scores the
    pool. That is the top k of a second full search whenever it lies in the pool, which the
    service's measurements found for the top 10 (docs/service.md, docs/scale.md). 0:
    expand (``vectors`` (rows, d) -> (M, D >= d) reads the n best photos' stored vectors),
    then search the whole index again."""
    if not cfg.active:
        return search(queries, k)
    if rescore <= 0:
        return search(expand_with(queries, search, vectors, cfg), k)
    rows, coded, based = pool(queries, max(RESCORE_MIN, rescore * k, cfg.n))
    width = min(k, rows.shape[1])
    out_scores = np.full((len(queries), width), -np.inf, dtype=np.float32)
    out_rows = np.full((len(queries), width), -1, dtype=np.int64)
    for i, (r, v) in enumerate(zip(rows, coded, strict=True)):
        r = r[r >= 0]
        if not len(r):
            continue
        first = np.argsort(-(v @ based[i]), kind="stable")[: cfg.n]
        s = v @ expand(based[i : i + 1], v[None, first], cfg)[0]
        top = np.argsort(-s, kind="stable")[:width]
        out_scores[i, : len(top)] = s[top]
        out_rows[i, : len(top)] = r[top]
    return out_scores, out_rows
