"""What an index kind is, and the one registry of them.

A kind is one object (`Kind`) that knows how to build its FAISS index from a gallery's
vectors (in memory or streamed from shards: `build` takes blocks), how many bytes the index
takes for N photos of D dims and with which parameters (`plan`), and how it answers a query
on a d-prefix (`search`; by default the query is zero-padded past d, which for an
inner-product index scores exactly the d-prefix). `index.build`, `index.sharded`,
`index.add`, `index.store` and the service only look kinds up here: adding a kind is one
`register(...)` call with its object.
"""

from __future__ import annotations

import abc
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from index.blocks import Block, array_blocks
from index.search import pad_queries

__all__ = ["Kind", "DoesNotFit", "KINDS", "register", "get", "choose", "resolve",
           "parse_bytes", "reconstruct_all", "row_map"]

_SIZES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class DoesNotFit(ValueError):
    """No parameters of a kind fit a memory budget; `least` is the fewest bytes it needs."""

    def __init__(self, message: str, least: int):
        super().__init__(message)
        self.least = least


@dataclass(frozen=True)
class Kind(abc.ABC):
    """One index kind. `exact`: its scores are the exact d-prefix inner products (no recall
    is measured); `gpu`: FAISS can copy it to a GPU for serving; `rank`: the budget
    chooser's preference (lower: more exact, tried first; None: never chosen by "auto");
    `max_auto_count`: "auto" takes it only up to this many photos. `streams`: it is built
    block by block without holding every vector (`index.build` then builds through shards)."""

    streams = False  # built from blocks without holding every vector (large galleries)

    name: str
    summary: str
    exact: bool = False
    gpu: bool = False
    rank: float | None = None
    max_auto_count: int | None = None

    def params(self, count: int, dims: int, nprobe: int = 0) -> dict:
        """The kind's parameters for `count` vectors of `dims` (stored in the sidecar)."""
        return {}

    @abc.abstractmethod
    def memory(self, count: int, dims: int, params: dict) -> int:
        """Bytes of the index of `count` vectors of `dims` (what a server maps)."""

    def plan(self, count: int, dims: int, budget: int | None = None, nprobe: int = 0) -> dict:
        """Parameters within `budget` bytes (None: no limit); DoesNotFit when none fit."""
        params = self.params(count, dims, nprobe)
        need = self.memory(count, dims, params)
        if budget is not None and need > budget:
            raise DoesNotFit(f"{self.name} over {count} vectors of {dims} dims needs {need} "
                             f"bytes ({need / 2**30:.2f} G), more than {budget}", need)
        return params

    @abc.abstractmethod
    def build(self, blocks: list[Block], dims: int, params: dict, work: Path | None = None,
              seed: int = 0, progress: bool = False) -> faiss.Index:
        """The index of the first `dims` columns of the blocks' vectors. Kinds that hold
        float32 vectors load them all; the code kinds stream the blocks, keeping their work
        files in `work` to resume an interrupted build (None: none kept)."""

    def build_vectors(self, vectors: np.ndarray, params: dict) -> faiss.Index:
        """The index of `vectors` (N, dims) held in memory."""
        return self.build(array_blocks(vectors), vectors.shape[1], params)

    def search(self, index: faiss.Index, queries: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of d-prefix queries (N, d), d <= the stored dims: (scores, rows) (N, k)."""
        return index.search(pad_queries(queries, index.d), k)

    def add(self, index: faiss.Index, vectors: np.ndarray) -> None:
        """Append vectors (M, dims) to a built index (index.add)."""
        index.add(np.ascontiguousarray(vectors, dtype=np.float32))

    def reconstruct(self, index: faiss.Index, start: int, count: int) -> np.ndarray:
        """Stored rows start..start+count as vectors (count, dims), decoded for code kinds."""
        row_map(index)
        return index.reconstruct_n(start, count)

    def vectors(self, index: faiss.Index, rows: np.ndarray, dims: int | None = None
                ) -> np.ndarray:
        """The stored vectors of `rows` (M,), in that order: (M, D), decoded for code kinds
        (what the index scores them by); D >= `dims` (None: all stored dims; a kind that
        decodes by parts may stop after the first `dims`). Row by row through the row map:
        an IVF index's `reconstruct_n` walks every list, whatever the count."""
        if len(rows) == 0:
            return np.zeros((0, index.d), dtype=np.float32)
        row_map(index)
        return index.reconstruct_batch(np.asarray(rows, dtype=np.int64))

    def pool(self, index: faiss.Index, queries: np.ndarray, count: int
             ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """Candidates to re-score for queries near `queries` (N, d), for the service's query
        expansion (training.cdk.model.smoothing.expanded_search): rows (N, count'), -1 where
        none; for each query the valid rows' vectors (count'', d') and the queries (N, d'),
        in a basis where their inner products are the index's scores. Here the kind's own
        top `count`, decoded, and the queries as they are. A kind whose search costs grow
        with k gives the rows it decodes anyway, in its own basis (scanprefix)."""
        d = queries.shape[1]
        rows = self.search(index, queries, count)[1]
        return rows, [self.vectors(index, r[r >= 0], d)[:, :d] for r in rows], queries


_ROW_MAP_LOCK = threading.Lock()


def row_map(index: faiss.Index) -> None:
    """Give an IVF index its row -> (list, offset) map, once (IVF lists keep none by default;
    making it again would rebuild it, and the service reads rows from several threads); no-op
    for other indexes."""
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        return  # not an IVF index
    with _ROW_MAP_LOCK:
        if ivf.direct_map.type == faiss.DirectMap.NoMap:
            ivf.make_direct_map()


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind to the registry (its name must be new); returns it."""
    if kind.name in KINDS or kind.name == "auto":
        raise ValueError(f"index kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def get(name: str) -> Kind:
    """The registered kind called `name`; ValueError naming the choices otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown index kind {name!r}; choose one of auto, "
                         f"{', '.join(KINDS)}") from None


def choose(count: int, dims: int, budget: int | None = None, nprobe: int = 0
           ) -> tuple[Kind, dict]:
    """The most exact kind (lowest rank) whose index of `count` vectors of `dims` fits
    `budget` bytes, with its parameters; DoesNotFit naming the least memory otherwise."""
    least = math.inf
    ranked = sorted((k for k in KINDS.values() if k.rank is not None), key=lambda k: k.rank)
    for kind in ranked:
        if kind.max_auto_count is not None and count > kind.max_auto_count:
            continue
        try:
            return kind, kind.plan(count, dims, budget, nprobe)
        except DoesNotFit as err:
            least = min(least, err.least)
        except ValueError:
            continue  # the kind cannot index this gallery (too few vectors to train)
    raise DoesNotFit(f"--max-index-memory {budget} bytes is too small for any index kind over "
                     f"{count} vectors of {dims} dims: the smallest needs {int(least)} bytes "
                     f"({least / 2**30:.2f} G)", int(least))


def resolve(name: str, count: int, dims: int, budget: int | None = None, nprobe: int = 0
            ) -> tuple[Kind, dict]:
    """`name` ("auto" or a registered kind) and its parameters for this gallery."""
    if name == "auto":
        return choose(count, dims, budget, nprobe)
    kind = get(name)
    return kind, kind.plan(count, dims, budget, nprobe)


def reconstruct_all(kind: Kind, index: faiss.Index, chunk: int = 65_536) -> list[Block]:
    """The stored vectors of an index as blocks of `chunk` rows, decoded when read."""
    from functools import partial

    n = index.ntotal
    return [Block(f"stored-{s}", s, min(chunk, n - s),
                  partial(kind.reconstruct, index, s, min(chunk, n - s)))
            for s in range(0, n, chunk)]


def parse_bytes(text: str) -> int:
    """'3G' -> 3 * 2**30; K/M/G/T are powers of 1024, a plain number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"memory size {text!r} is not a number with an optional K/M/G/T suffix")
    return int(float(match[1]) * _SIZES[match[2].upper()])
