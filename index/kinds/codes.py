"""Kinds that store compressed codes in inverted lists, for galleries larger than RAM.

    ivfsq8  k-means cells + an 8-bit scalar quantizer per dimension: dims bytes a photo
            (+ 8 for its id).
    ivfpq   cells + product quantization, m bytes a photo (m sub-vectors of dims/m).
    opq     the same behind a learned rotation (OPQ), which evens out the sub-vectors'
            variance; slow to train.

A d-prefix query is zero-padded, as for the flat kind. The scalar quantizer codes each
dimension on its own, so the score is the inner product of the d-prefix with the decoded
d-prefix; PQ without rotation too when d is a multiple of dims/m; OPQ mixes all dimensions,
so its error at small d is that of the whole vector. A query scans the same codes at every d.

Building never holds all vectors (`build_codes`): the quantizers are trained on a seeded
sample of the blocks, then each block is encoded on its own into cell numbers and codes
(kept in a work folder, so an interrupted build resumes at the first block not yet encoded)
and the codes are added block by block; the result equals FAISS's own `add` of all vectors.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from index.blocks import Block, npy_bytes, sample_vectors, total
from index.kinds.base import DoesNotFit, Kind, register
from index.kinds.floats import ID_BYTES
from training.files import atomic_write_bytes

__all__ = ["IvfCodes", "SQ8", "PQ", "OPQ", "build_codes", "default_nlist"]

log = logging.getLogger(__name__)

SAMPLE_PER_CELL = 64  # k-means training points per cell (FAISS warns below 39)
MIN_SAMPLE = 65_536  # PQ codebooks: 256 centroids x 256 points
DEFAULT_NPROBE = 64
MIN_PQ_COUNT = 39 * 256  # FAISS's least training points for 256 centroids


def default_nlist(count: int) -> int:
    """A power of two near sqrt(N), with at least SAMPLE_PER_CELL photos per cell."""
    nlist = 2 ** round(math.log2(max(1.0, math.sqrt(count))))
    while nlist > 1 and count < SAMPLE_PER_CELL * nlist:
        nlist //= 2
    return nlist


@dataclass(frozen=True)
class IvfCodes(Kind):
    """Inverted lists of codes: trained on a sample, filled block by block."""

    streams = True

    def params(self, count: int, dims: int, nprobe: int = 0) -> dict:
        nlist = default_nlist(count)
        return {"nlist": nlist, "nprobe": min(nlist, nprobe or DEFAULT_NPROBE)}

    @abc.abstractmethod
    def train(self, sample: np.ndarray, params: dict) -> faiss.Index:
        """An empty index trained on `sample` (n, dims)."""

    def encode(self, index: faiss.Index, vectors: np.ndarray) -> np.ndarray:
        """(n, dims) -> (n, bytes) uint8: each vector's cell number and code."""
        return index.sa_encode(np.ascontiguousarray(vectors, dtype=np.float32))

    def add_codes(self, index: faiss.Index, codes: np.ndarray, start: int) -> None:
        """Append encoded vectors as rows start, start + 1, ..."""
        ivf = faiss.extract_index_ivf(index)
        ivf.add_sa_codes(codes, np.arange(start, start + len(codes), dtype=np.int64))
        index.ntotal = ivf.ntotal  # a wrapper (OPQ) counts only what was added through it

    def add(self, index: faiss.Index, vectors: np.ndarray) -> None:
        self.add_codes(index, self.encode(index, vectors), index.ntotal)

    def build(self, blocks: list[Block], dims: int, params: dict, work: Path | None = None,
              seed: int = 0, progress: bool = False) -> faiss.Index:
        return build_codes(self, blocks, dims, params, work, seed, progress)


@dataclass(frozen=True)
class ScalarCodes(IvfCodes):
    def memory(self, count: int, dims: int, params: dict) -> int:
        return count * (dims + ID_BYTES) + params["nlist"] * dims * 4 + 2 * dims * 4

    def train(self, sample: np.ndarray, params: dict) -> faiss.Index:
        return _train_factory(f"IVF{params['nlist']},SQ8", sample, params)


@dataclass(frozen=True)
class ProductCodes(IvfCodes):
    rotate: bool = False  # OPQ: a learned rotation before the product quantizer

    def plan(self, count: int, dims: int, budget: int | None = None, nprobe: int = 0) -> dict:
        """The most sub-vectors m (bytes a photo; a divisor of dims, at most dims/2: one
        dimension a sub-vector is a scalar quantizer, which ivfsq8 does faster) that fit."""
        if count < MIN_PQ_COUNT:
            raise ValueError(f"{self.name} trains 256 centroids per sub-vector and needs at "
                             f"least {MIN_PQ_COUNT} vectors, the gallery has {count}; use "
                             "ivfsq8 or flat")
        ms = [m for m in range(dims // 2, 0, -1) if dims % m == 0]
        if not ms:
            raise ValueError(f"{self.name} needs dims >= 2, got {dims}")
        base = self.params(count, dims, nprobe)
        for m in ms:
            params = {**base, "m": m}
            if budget is None or self.memory(count, dims, params) <= budget:
                return params
        least = self.memory(count, dims, {**base, "m": ms[-1]})
        raise DoesNotFit(f"--max-index-memory {budget} bytes is too small for {self.name} over "
                         f"{count} vectors of {dims} dims: it needs at least {least} bytes "
                         f"({least / 2**30:.2f} G)", least)

    def memory(self, count: int, dims: int, params: dict) -> int:
        fixed = params["nlist"] * dims * 4 + 256 * dims * 4  # centroids, codebooks
        fixed += dims * dims * 4 if self.rotate else 0
        return count * (params["m"] + ID_BYTES) + fixed

    def train(self, sample: np.ndarray, params: dict) -> faiss.Index:
        m, nlist = params["m"], params["nlist"]
        spec = f"OPQ{m},IVF{nlist},PQ{m}" if self.rotate else f"IVF{nlist},PQ{m}"
        return _train_factory(spec, sample, params)


def _train_factory(spec: str, sample: np.ndarray, params: dict) -> faiss.Index:
    index = faiss.index_factory(sample.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    if isinstance(ivf, faiss.IndexIVFPQ):
        # The factory turns on polysemous training (Hamming filtering, unused here): it was
        # 30 of the 31 s of training IVF128,PQ16 on 20,000 vectors.
        ivf.do_polysemous_training = False
    index.train(sample)
    faiss.extract_index_ivf(index).nprobe = params["nprobe"]
    return index


def work_key(kind: IvfCodes, params: dict, blocks: list[Block], dims: int, seed: int) -> str:
    """Names a build's work files: the kind, its parameters, the dims, the seed, the blocks."""
    digest = hashlib.sha256(repr((kind.name, sorted(params.items()), dims, seed)).encode())
    for block in blocks:
        digest.update(f"|{block.name}|{block.start}|{block.count}".encode())
    return digest.hexdigest()[:16]


def _trained(kind: IvfCodes, blocks: list[Block], dims: int, params: dict, path: Path | None,
             seed: int) -> faiss.Index:
    if path is not None and path.is_file():
        log.info("reusing the trained %s index %s", kind.name, path)
        return faiss.read_index(str(path))
    n = min(total(blocks), max(MIN_SAMPLE, SAMPLE_PER_CELL * params.get("nlist", 1)))
    log.info("training %s %s on %d of %d vectors", kind.name, params, n, total(blocks))
    sample = np.ascontiguousarray(sample_vectors(blocks, n, seed)[:, :dims])
    index = kind.train(sample, params)
    if path is not None:
        atomic_write_bytes(faiss.serialize_index(index).tobytes(), path)
    return index


def build_codes(kind: IvfCodes, blocks: list[Block], dims: int, params: dict,
                work: Path | None = None, seed: int = 0, progress: bool = False,
                on_block: Callable[[Block], None] | None = None) -> faiss.Index:
    """Train on a sample, encode each block (resumable), add the codes; returns the index.

    With a `work` folder the trained index and each block's codes are kept there under a
    key of the kind, its parameters and the blocks, so a rerun after an interruption trains
    and encodes only what is missing. `on_block(block)` is called after each block is added
    (tests interrupt the build there).
    """
    key = work_key(kind, params, blocks, dims, seed)
    index = _trained(kind, blocks, dims, params,
                     None if work is None else work / f"trained-{key}.faiss", seed)
    bar = tqdm(total=total(blocks), desc=f"encoding ({kind.name})", unit="vec",
               disable=not progress)
    for block in blocks:
        path = None if work is None else work / f"codes-{key}-{block.name}.npy"
        if path is not None and path.is_file():
            codes = np.load(path)
        else:
            codes = kind.encode(index, block.load()[:, :dims])  # (count, bytes) uint8
            if path is not None:
                atomic_write_bytes(npy_bytes(codes), path)
        kind.add_codes(index, codes, block.start)
        bar.update(block.count)
        if on_block is not None:
            on_block(block)
    bar.close()
    return index


SQ8 = register(ScalarCodes("ivfsq8", "k-means cells + 8-bit scalar codes: dims bytes a photo",
                           rank=2))
OPQ = register(ProductCodes("opq", "cells + rotation + product codes: m bytes a photo",
                            rank=4, rotate=True))
PQ = register(ProductCodes("ivfpq", "cells + product codes (no rotation): m bytes a photo"))
