"""Gallery smoothing of the stored photo vectors, with the neighbours found by FAISS in
bounded memory (the rule is training.cdk.model.smoothing's).

Each round maps the gallery's vectors to new ones: every photo is averaged with its k most
cosine-similar photos of the previous round (itself excluded),

    g <- (g + weight * mean(neighbours)) / (1 + weight).

`smooth_blocks` runs a round over blocks of rows (in memory, or the shards of a sharded
build, one at a time) and keeps the round's output as new blocks (in memory, or files next
to the shards). The neighbours come from an index of all the photos' unit-length vectors:
exact (flat) up to EXACT_MAX photos, above that a code index that holds a byte or half a
byte a coordinate instead of four (ivfsq8, else the mixed kind, within the build's memory
budget), built block by block. Queries go in chunks of QUERY_CHUNK rows aligned on the
gallery's row numbers, so the same blocks give the same bits on every build path.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from index.blocks import Block, array_blocks, concat, gather_rows, npy_bytes, total
from index.kinds import DoesNotFit, get
from index.kinds.floats import AUTO_FLAT_MAX
from training.cdk.model.smoothing import Smoothing
from training.files import atomic_write_bytes

__all__ = ["EXACT_MAX", "NeighbourIndex", "faiss_neighbours", "smooth_blocks", "smooth_added",
           "model_smoothing", "memory_store", "folder_store"]

log = logging.getLogger(__name__)

EXACT_MAX = AUTO_FLAT_MAX  # exact neighbours up to this many photos
APPROXIMATE = ("ivfsq8", "ivfsq48")  # the neighbour index above it, the first that fits
QUERY_CHUNK = 1024
# (name, first row, compute () -> (n, width)) -> the block holding what compute returned
Store = Callable[[str, int, Callable[[], np.ndarray]], Block]


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


class NeighbourIndex:
    """The k most cosine-similar rows of a gallery given as blocks, each row itself
    excluded: exact up to EXACT_MAX rows, else from a code index within `budget` bytes."""

    def __init__(self, blocks: list[Block], k: int, budget: int | None = None):
        self.k, self.count = k, total(blocks)
        width = blocks[0].count and blocks[0].load().shape[1]
        unit = [Block(b.name, b.start, b.count, partial(_unit_block, b)) for b in blocks]
        if self.count <= EXACT_MAX:
            self.kind, params = get("flat"), {}
        else:
            self.kind, params = _approximate(self.count, width, budget)
            params = {**params, "nprobe": min(params["nlist"], max(params["nprobe"], 2 * k))}
        self.index = self.kind.build(unit, width, params)

    def search(self, rows: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        """rows (R,) of the gallery and their vectors (R, width) -> (R, k) neighbour rows."""
        k = self.k
        _, ids = self.kind.search(self.index, _unit(vectors), k + 1)  # (R, k + 1)
        is_self = ids == rows[:, None]
        keep = ~is_self  # drop the row itself where found, else the farthest of the k + 1
        keep[~is_self.any(1), k] = False
        out = ids[keep].reshape(len(rows), k)
        if (out < 0).any():
            raise RuntimeError(f"the neighbour search found fewer than {k} neighbours for some "
                               "photos; rebuild with a smaller smoothing k")
        return out


def _unit_block(block: Block) -> np.ndarray:
    return _unit(block.load())


def _approximate(count: int, width: int, budget: int | None):
    for name in APPROXIMATE:
        kind = get(name)
        try:
            return kind, kind.plan(count, width, budget)
        except DoesNotFit:
            continue
    raise DoesNotFit(f"--max-index-memory {budget} is too small for the smoothing neighbours' "
                     f"index over {count} photos of {width} dims", 0)


def faiss_neighbours(g: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """(N, d), k, rows (R,) -> (R, k): the k rows most cosine-similar to each of `rows`,
    itself excluded (training.cdk.model.smoothing.Neighbours), by `NeighbourIndex`."""
    x = np.ascontiguousarray(g.float().numpy())
    r = rows.numpy()
    return torch.from_numpy(NeighbourIndex(array_blocks(x), k).search(r, x[r]))


def memory_store(name: str, start: int, compute: Callable[[], np.ndarray]) -> Block:
    """Keep a round's block in memory."""
    x = compute()
    return array_blocks(x, offset=start)[0] if len(x) else Block(name, start, 0, lambda: x)


def folder_store(folder: Path) -> Store:
    """Keep each round's blocks as .npy files in `folder` (reused by a rerun)."""

    def put(name: str, start: int, compute: Callable[[], np.ndarray]) -> Block:
        path = folder / f"{name}.npy"
        if not path.is_file():
            atomic_write_bytes(npy_bytes(compute().astype(np.float32)), path)
        count = np.load(path, mmap_mode="r").shape[0]
        return Block(name, start, count, partial(np.load, path, mmap_mode="r"))

    return put


def _signature(blocks: list[Block], cfg: Smoothing, fixed: int, budget: int | None) -> str:
    digest = hashlib.sha256(repr((cfg.as_dict(), fixed, budget)).encode())
    for b in blocks:
        digest.update(f"|{b.name}|{b.start}|{b.count}".encode())
    return digest.hexdigest()[:16]


def _smooth_block(block: Block, finder: NeighbourIndex, current: list[Block],
                  weight: float) -> np.ndarray:
    x = np.asarray(block.load(), dtype=np.float32)  # (n, width)
    out = np.empty_like(x)
    first = block.start
    cuts = [first, *range((first // QUERY_CHUNK + 1) * QUERY_CHUNK, first + block.count,
                          QUERY_CHUNK), first + block.count]
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        rows = np.arange(s, e)
        ids = finder.search(rows, x[s - first : e - first])  # (c, k)
        mean = gather_rows(current, ids.ravel()).reshape(len(rows), finder.k, -1).mean(1)
        out[s - first : e - first] = (x[s - first : e - first] + weight * mean) / (1 + weight)
    return out


def smooth_blocks(blocks: list[Block], cfg: Smoothing, store: Store = memory_store,
                  fixed: int = 0, budget: int | None = None) -> list[Block]:
    """The gallery smoothed by `cfg`, as blocks like `blocks` (rows below `fixed` held
    fixed: their blocks are returned as they are). Unchanged when `cfg` is off or the
    gallery has no other photo to average with."""
    n = total(blocks)
    k = min(cfg.k, n - 1)
    if not cfg.active or k < 1 or fixed >= n:
        return blocks
    if any(b.start < fixed < b.start + b.count for b in blocks):
        raise ValueError(f"row {fixed} splits a block: fixed rows must fill whole blocks")
    t0 = time.perf_counter()
    sig = _signature(blocks, cfg, fixed, budget)
    current = blocks
    for r in range(cfg.rounds):
        finder = NeighbourIndex(current, k, budget)
        current = [b if b.start < fixed else
                   store(f"smooth-{sig}-r{r}-{b.name}", b.start,
                         partial(_smooth_block, b, finder, current, cfg.weight))
                   for b in current]
        del finder
    log.info("smoothed %d photos with their %d nearest neighbours (weight %g, %d rounds) in "
             "%.1fs", n - fixed, k, cfg.weight, cfg.rounds, time.perf_counter() - t0)
    return current


def smooth_added(stored: np.ndarray, new: np.ndarray, cfg: Smoothing) -> np.ndarray:
    """(M, d) vectors about to be added to an index whose N stored vectors (N, d) were
    smoothed with `cfg` -> smoothed against the stored photos and each other, the stored
    ones held fixed: photos added later are averaged with their neighbours as built ones
    were (the stored photos do not see the new ones until a rebuild)."""
    if not cfg.active or len(new) == 0:
        return new
    n = len(stored)
    blocks = [*array_blocks(np.asarray(stored, np.float32)),
              *array_blocks(np.asarray(new, np.float32), offset=n)]
    return concat(smooth_blocks(blocks, cfg, fixed=n)[1 if n else 0:])


def model_smoothing(model, k: int | None = None, weight: float | None = None,
                    rounds: int | None = None) -> Smoothing:
    """The smoothing the model bundle asks for (its inference block), with the given values
    overriding its own (None keeps the model's)."""
    own = model.inference.gallery_smoothing()
    return Smoothing(own.k if k is None else k, own.weight if weight is None else weight,
                     own.rounds if rounds is None else rounds)
