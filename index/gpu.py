"""GPU placement of FAISS indexes: whether a GPU is usable, and copying an index onto it."""

from __future__ import annotations

import threading

import faiss
import numpy as np

__all__ = ["gpu_available", "to_gpu", "SerializedIndex"]


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


class SerializedIndex:
    """A FAISS index whose searches and row reads run one at a time.

    FAISS documents GPU indexes as not thread-safe (CPU indexes are, for search); a server
    searching from a thread pool wraps a GPU index in this (query expansion reads stored rows
    between searches). Other attributes pass through.
    """

    def __init__(self, index: faiss.Index):
        self.index = index
        self._lock = threading.Lock()

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(N, d) queries -> (scores (N, k), ids (N, k)), as ``faiss.Index.search``."""
        with self._lock:
            return self.index.search(queries, k)

    def reconstruct_batch(self, rows: np.ndarray) -> np.ndarray:
        """(M,) rows -> (M, d) stored vectors, as ``faiss.Index.reconstruct_batch``."""
        with self._lock:
            return self.index.reconstruct_batch(rows)

    def __getattr__(self, name: str):
        return getattr(self.index, name)
