"""Kinds that hold the float32 vectors: exact search ("flat"), inverted lists over k-means
cells ("ivf") and a graph ("hnsw"). They are built from all vectors in memory; flat and
ivf can be served from a GPU. The approximate ones have their recall against exact search
measured at build time.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from index.blocks import Block, concat
from index.gpu import gpu_available, to_gpu
from index.kinds.base import Kind, register

__all__ = ["AUTO_FLAT_MAX", "IVF_NPROBE", "HNSW_M", "HNSW_EF_SEARCH", "FLAT", "IVF", "HNSW"]

# Exact search stays fast (a few ms per query on CPU) up to about this many photos.
AUTO_FLAT_MAX = 100_000
ID_BYTES = 8  # FAISS stores an int64 id per vector in inverted lists
# Inverted lists probed per query: 16 found 0.87 of the exact top-10 of sketch-like queries
# at d=16 over 20,000 photos (tests/index/test_kinds.py); 64 finds 0.99.
IVF_NPROBE = 64
HNSW_M = 32
HNSW_EF_SEARCH = 128


@dataclass(frozen=True)
class HeldInMemory(Kind):
    """A kind built from every vector at once (N x dims float32 in memory)."""

    def build(self, blocks: list[Block], dims: int, params: dict, work: Path | None = None,
              seed: int = 0, progress: bool = False) -> faiss.Index:
        return self.make(concat(blocks, dims), params)

    @abc.abstractmethod
    def make(self, vectors: np.ndarray, params: dict) -> faiss.Index:
        """The index holding `vectors` (N, dims)."""


@dataclass(frozen=True)
class Flat(HeldInMemory):
    def memory(self, count: int, dims: int, params: dict) -> int:
        return count * dims * 4

    def make(self, vectors: np.ndarray, params: dict) -> faiss.Index:
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        return index


@dataclass(frozen=True)
class Ivf(HeldInMemory):
    def params(self, count: int, dims: int, nprobe: int = 0) -> dict:
        # about 4 sqrt(N) cells, at least 39 points per cell (FAISS's k-means minimum)
        nlist = max(1, min(int(4 * math.sqrt(count)), count // 39))
        return {"nlist": nlist, "nprobe": min(nlist, nprobe or IVF_NPROBE)}

    def memory(self, count: int, dims: int, params: dict) -> int:
        return count * (dims * 4 + ID_BYTES) + params["nlist"] * dims * 4

    def make(self, vectors: np.ndarray, params: dict) -> faiss.Index:
        d = vectors.shape[1]
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, params["nlist"],
                                   faiss.METRIC_INNER_PRODUCT)
        trainer = to_gpu(index) if gpu_available() else index
        trainer.train(vectors)
        if trainer is not index:
            index = faiss.index_gpu_to_cpu(trainer)
        index.add(vectors)
        index.nprobe = params["nprobe"]
        return index


@dataclass(frozen=True)
class Hnsw(HeldInMemory):
    def params(self, count: int, dims: int, nprobe: int = 0) -> dict:
        return {"M": HNSW_M, "ef_search": HNSW_EF_SEARCH}

    def memory(self, count: int, dims: int, params: dict) -> int:
        # vectors, 2M links a node on level 0 (int32), about 1/M of that above, the levels
        return count * (dims * 4 + 2 * params["M"] * 4 + 8 + 16)

    def make(self, vectors: np.ndarray, params: dict) -> faiss.Index:
        index = faiss.IndexHNSWFlat(vectors.shape[1], params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 2 * params["ef_search"]
        index.add(vectors)
        index.hnsw.efSearch = params["ef_search"]
        return index


FLAT = register(Flat("flat", "exact inner-product scan of float32 vectors", exact=True,
                     gpu=True, rank=0, max_auto_count=AUTO_FLAT_MAX))
IVF = register(Ivf("ivf", "k-means cells over float32 vectors, nprobe cells scanned a query",
                   gpu=True, rank=1))
HNSW = register(Hnsw("hnsw", "HNSW graph over float32 vectors (CPU only)"))
