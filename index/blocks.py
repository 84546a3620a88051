"""A gallery's vectors in blocks of consecutive rows: in memory, or memory-mapped shards on
disk read one at a time, so nothing downstream (smoothing, index building, recall) needs
all of them in RAM at once.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

__all__ = ["Block", "array_blocks", "total", "sample_vectors", "gather_rows", "iter_arrays",
           "concat", "npy_bytes"]


@dataclass(frozen=True)
class Block:
    """Rows start..start+count of the gallery's vectors, read by `load` ((count, width),
    float32, possibly memory-mapped) when needed; `name` identifies it in work-file names."""

    name: str
    start: int
    count: int
    load: Callable[[], np.ndarray]


def _view(vectors: np.ndarray) -> np.ndarray:
    return vectors


def array_blocks(vectors: np.ndarray, size: int | None = None, offset: int = 0) -> list[Block]:
    """Blocks over an in-memory array (N, width), `size` rows each (None: one block), the
    first holding gallery row `offset`."""
    n = len(vectors)
    size = size or max(1, n)
    return [Block(f"rows-{offset + s}-{offset + min(s + size, n)}", offset + s,
                  min(size, n - s), partial(_view, vectors[s : s + size]))
            for s in range(0, n, size)]


def total(blocks: list[Block]) -> int:
    return sum(b.count for b in blocks)


def sample_vectors(blocks: list[Block], n: int, seed: int = 0) -> np.ndarray:
    """A seeded uniform sample (n, width) of the rows, read block by block; the same rows
    whatever the blocks' sizes."""
    count = total(blocks)
    n = min(n, count)
    picks = np.sort(np.random.default_rng(seed).choice(count, size=n, replace=False))
    return gather_rows(blocks, picks)


def gather_rows(blocks: list[Block], rows: np.ndarray) -> np.ndarray:
    """The vectors of gallery rows `rows` (any order, repeats allowed) -> (len(rows), width)
    float32, each block read once."""
    rows = np.asarray(rows, dtype=np.int64).ravel()
    starts = np.array([b.start for b in blocks], dtype=np.int64)
    owner = np.searchsorted(starts, rows, side="right") - 1
    out = None
    for b in np.unique(owner):
        block = blocks[b]
        hit = np.flatnonzero(owner == b)
        part = np.asarray(block.load()[rows[hit] - block.start], dtype=np.float32)
        if out is None:
            out = np.empty((len(rows), part.shape[1]), dtype=np.float32)
        out[hit] = part
    if out is None:  # no rows asked for
        width = blocks[0].load().shape[1] if blocks else 0
        out = np.zeros((0, width), dtype=np.float32)
    return out


def iter_arrays(blocks: list[Block], dims: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(start, first `dims` columns of the block as float32 C-contiguous) per block."""
    for b in blocks:
        x = b.load()
        yield b.start, np.ascontiguousarray(x if dims is None else x[:, :dims], dtype=np.float32)


def concat(blocks: list[Block], dims: int | None = None) -> np.ndarray:
    """All rows in one array (N, dims): only for kinds that hold every vector anyway."""
    parts = [x for _, x in iter_arrays(blocks, dims)]
    return np.concatenate(parts) if parts else np.zeros((0, dims or 0), np.float32)


def npy_bytes(array: np.ndarray) -> bytes:
    """The bytes of `array` as a .npy file (written atomically by the callers)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array))
    return buf.getvalue()
