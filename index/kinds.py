"""FAISS index kinds over inner product, chosen by name or by gallery size.

Scores are plain inner products of d-prefixes, so one index over the stored dims serves every
d: a query is zero-padded beyond d. "flat" is exact; "ivf" and "hnsw" are approximate and
their recall against exact search is measured at build time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import faiss
import numpy as np

log = logging.getLogger(__name__)

# Exact search stays fast (a few ms per query on CPU) up to about this many photos.
AUTO_FLAT_MAX = 100_000
IVF_NPROBE = 16
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


def gpu_available() -> bool:
    """True when FAISS was built with GPU support and a GPU is visible."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


_GPU_RESOURCES = None


def to_gpu(index: faiss.Index) -> faiss.Index:
    """Copy an index to GPU 0 (flat and IVF kinds); raises without GPU FAISS."""
    global _GPU_RESOURCES
    if not gpu_available():
        raise RuntimeError("no GPU FAISS: install faiss-gpu and make a CUDA device visible")
    if _GPU_RESOURCES is None:
        _GPU_RESOURCES = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES, 0, index)


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


def recall_at_k(
    index: faiss.Index,
    vectors: np.ndarray,
    k: int = 10,
    dims: int | None = None,
    n_queries: int = 1000,
    seed: int = 0,
) -> float:
    """Fraction of the exact top-k found by `index`, queries drawn from the gallery itself.

    `vectors` (N, D) are the stored embeddings; `dims` <= D selects the prefix being scored.
    """
    n, stored = vectors.shape
    d = stored if dims is None else dims
    k = min(k, n)
    rng = np.random.default_rng(seed)
    picks = rng.choice(n, size=min(n_queries, n), replace=False)
    queries = np.ascontiguousarray(vectors[picks, :d])
    _, truth = exact_topk(np.ascontiguousarray(vectors[:, :d]), queries, k)
    _, found = index.search(pad_queries(queries, stored), k)
    hits = sum(len(set(t) & set(f[f >= 0])) for t, f in zip(truth, found, strict=True))
    return hits / (len(picks) * k)
