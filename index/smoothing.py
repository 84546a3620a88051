"""Gallery smoothing at build and append time (the rule: training.cdk.model.smoothing), with the
neighbours found by FAISS: exact search up to ``kinds.AUTO_FLAT_MAX`` photos, an HNSW graph
above (a build of 10^6 photos would otherwise spend ~10^12 inner products per round)."""

from __future__ import annotations

import logging
import time

import faiss
import numpy as np
import torch

from index.kinds import AUTO_FLAT_MAX, HNSW_EF_SEARCH, make_flat, make_hnsw
from training.cdk.config import from_dict, smoothing
from training.cdk.model.smoothing import Smoothing, smooth

__all__ = ["faiss_neighbours", "smooth_vectors", "smooth_added", "checkpoint_smoothing"]

log = logging.getLogger(__name__)


def faiss_neighbours(g: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """(N, d), k, rows (R,) -> (R, k): the k rows most cosine-similar to each of ``rows``,
    itself excluded (training.cdk.model.smoothing.Neighbours)."""
    x = np.ascontiguousarray(torch.nn.functional.normalize(g.float(), dim=1).numpy())
    if len(x) <= AUTO_FLAT_MAX:
        index = make_flat(x)
    else:
        index = make_hnsw(x)
        index.hnsw.efSearch = max(HNSW_EF_SEARCH, 2 * k)
    r = rows.numpy()
    _, ids = index.search(x[r], k + 1)  # (R, k + 1); the row itself is usually first
    ids = torch.from_numpy(ids)
    is_self = ids == torch.as_tensor(r)[:, None]
    # drop the row itself where found, else the farthest of the k + 1
    keep = ~is_self
    keep[~is_self.any(1), k] = False
    out = ids[keep].view(len(r), k)
    if (out < 0).any():
        raise RuntimeError(f"the neighbour search found fewer than {k} neighbours for some "
                           "photos; rebuild with a smaller smoothing k")
    return out


def smooth_vectors(vectors: np.ndarray, cfg: Smoothing, rows=None) -> np.ndarray:
    """(N, d) float32 photo vectors -> smoothed (N, d) float32 (``rows``: only these, the
    others held fixed)."""
    if not cfg.active:
        return vectors
    t0 = time.perf_counter()
    out = smooth(torch.from_numpy(np.asarray(vectors, dtype=np.float32)), cfg,
                 faiss_neighbours, rows).numpy()
    log.info("smoothed %d photos with their %d nearest neighbours (weight %g, %d rounds) "
             "in %.1fs", len(out) if rows is None else len(rows), cfg.k, cfg.weight,
             cfg.rounds, time.perf_counter() - t0)
    return np.ascontiguousarray(out)


def checkpoint_smoothing(config: dict, k: int | None = None, weight: float | None = None,
                         rounds: int | None = None) -> Smoothing:
    """The smoothing a checkpoint's config (an Embedder's ``config``) asks for, with the
    given values overriding its own (None keeps the checkpoint's; checkpoints from before
    smoothing existed have it off)."""
    own = smoothing(from_dict(config))
    return Smoothing(own.k if k is None else k, own.weight if weight is None else weight,
                     own.rounds if rounds is None else rounds)


def smooth_added(index: faiss.Index, new: np.ndarray, cfg: Smoothing) -> np.ndarray:
    """(M, d) vectors about to be added to ``index`` (whose N stored vectors were smoothed
    with ``cfg``) -> smoothed against the stored photos and each other, the stored ones held
    fixed: photos added later are averaged with their neighbours as built ones were (the
    stored photos do not see the new ones until a rebuild)."""
    if not cfg.active or len(new) == 0:
        return new
    n = index.ntotal
    if isinstance(index, faiss.IndexIVF):
        index.make_direct_map()  # IVF lists hold no row -> vector map by default
    stored = index.reconstruct_n(0, n) if n else np.zeros((0, new.shape[1]), np.float32)
    both = np.concatenate([stored, np.asarray(new, dtype=np.float32)])
    return smooth_vectors(both, cfg, rows=np.arange(n, n + len(new)))[n:]
