"""FAISS index kinds over inner product, chosen by name or by gallery size.

Scores are plain inner products of d-prefixes, so one index over the stored dims serves every
d: a query is zero-padded beyond d (``search.pad_queries``). "flat" is exact; "ivf" and "hnsw"
are approximate and their recall against exact search is measured at build time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import faiss
import numpy as np

from index.gpu import gpu_available, to_gpu

# Exact search stays fast (a few ms per query on CPU) up to about this many photos.
AUTO_FLAT_MAX = 100_000
# Inverted lists probed per query: 16 found 0.87 of the exact top-10 of sketch-like queries
# at d=16 over 20,000 photos (tests/index/test_kinds.py); 64 finds 0.99.
IVF_NPROBE = 64
HNSW_M = 32
HNSW_EF_SEARCH = 128


def make_flat(vectors: np.ndarray) -> faiss.Index:
    """Exact inner-product index holding `vectors` (N, d)."""
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


def make_ivf(vectors: np.ndarray) -> faiss.Index:
    """Inverted lists over k-means cells (about 4 sqrt(N) of them, >= 39 points per cell)."""
    n, d = vectors.shape
    nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    trainer = to_gpu(index) if gpu_available() else index
    trainer.train(vectors)
    if trainer is not index:
        index = faiss.index_gpu_to_cpu(trainer)
    index.add(vectors)
    index.nprobe = min(nlist, IVF_NPROBE)
    return index


def make_hnsw(vectors: np.ndarray) -> faiss.Index:
    """HNSW graph over inner product (CPU only in FAISS)."""
    index = faiss.IndexHNSWFlat(vectors.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 2 * HNSW_EF_SEARCH
    index.add(vectors)
    index.hnsw.efSearch = HNSW_EF_SEARCH
    return index


KINDS: dict[str, Callable[[np.ndarray], faiss.Index]] = {
    "flat": make_flat,
    "ivf": make_ivf,
    "hnsw": make_hnsw,
}


def choose_kind(count: int, kind: str = "auto") -> str:
    """Resolve "auto" by gallery size; validate an explicit kind."""
    if kind == "auto":
        return "flat" if count <= AUTO_FLAT_MAX else "ivf"
    if kind not in KINDS:
        raise ValueError(f"unknown index kind {kind!r}; choose one of auto, {', '.join(KINDS)}")
    return kind
