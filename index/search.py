"""Search over d-prefixes: queries zero-padded to the stored dims, and the exact top-k by
brute force (the reference recall is measured against: `index.assemble.blocks_recall`)."""

from __future__ import annotations

from collections.abc import Iterable

import faiss
import numpy as np

from index.gpu import gpu_available, to_gpu

__all__ = ["pad_queries", "exact_topk", "exact_topk_blocks"]


def pad_queries(queries: np.ndarray, stored_dims: int) -> np.ndarray:
    """(N, d) queries -> (N, stored_dims) with zeros beyond d: IP then equals the d-prefix IP."""
    n, d = queries.shape
    if not 1 <= d <= stored_dims:
        raise ValueError(f"query has {d} dims; the index stores {stored_dims}")
    padded = np.zeros((n, stored_dims), dtype=np.float32)
    padded[:, :d] = queries
    return padded


def exact_topk(vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k of `queries` (Q, d) against `vectors` (N, d): (scores, ids)."""
    index = faiss.IndexFlatIP(vectors.shape[1])
    if gpu_available():
        index = to_gpu(index)
    index.add(vectors)
    return index.search(queries, min(k, len(vectors)))


def exact_topk_blocks(
    blocks: Iterable[tuple[int, np.ndarray]], queries: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k of `queries` (Q, d) over vectors given in blocks
    (row offset, (n, d) array, e.g. memory-mapped shards), one block in memory at a time.

    Returns (scores (Q, k'), rows (Q, k')), k' = min(k, rows seen), scores descending."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    best_s = np.full((len(queries), 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((len(queries), 0), dtype=np.int64)
    for offset, block in blocks:
        scores, ids = exact_topk(np.ascontiguousarray(block, dtype=np.float32), queries, k)
        best_s = np.concatenate([best_s, scores], axis=1)
        best_i = np.concatenate([best_i, ids + offset], axis=1)
        order = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
        best_s = np.take_along_axis(best_s, order, 1)
        best_i = np.take_along_axis(best_i, order, 1)
    return best_s, best_i
