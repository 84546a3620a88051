"""Compressed index kinds for large galleries, chosen from a memory budget and built from shards.

    ivfsq8  inverted lists (k-means cells) + an 8-bit scalar quantizer per dimension:
            dims bytes a photo (+ 8 for its id). The default for large galleries.
    ivfpq   inverted lists + product quantization, m bytes a photo (m sub-vectors of dims/m).
    opq     the same behind a learned rotation (OPQ), which balances the variance of the
            sub-vectors; slow to train.

`dims` at query time: queries are zero-padded past d, as for the flat kind. The scalar
quantizer codes each dimension on its own, so the score of a padded query is the inner
product of the d-prefix with the decoded d-prefix (the codes past d meet zeros). PQ without
rotation too when d is a multiple of dims/m (the sub-vectors past d meet zero lookup
tables); OPQ mixes all dimensions, so its error at small d is that of the whole vector. The
cost: a query scans the same codes at every d (all dims are decoded, the zeros included), and
the cells were clustered on the whole vectors, so at small d the true neighbours are spread
over more cells and recall at a given nprobe is lower (measured: README, "Scale").

Building never holds all vectors: the quantizers are trained on a seeded sample of the
shards, each shard is then encoded on its own (cell number + code per photo, written
atomically next to the shards, so an interrupted build resumes at the first shard not yet
encoded) and the codes are added to the index shard by shard.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from index.kinds import AUTO_FLAT_MAX
from index.shards import ShardPlan, npy_bytes, read_shard
from training.files import atomic_write_bytes

log = logging.getLogger(__name__)

COMPRESSED_KINDS = ("ivfsq8", "ivfpq", "opq")
ID_BYTES = 8  # FAISS stores an int64 id per vector in the inverted lists
SAMPLE_PER_CELL = 64  # k-means training points per cell (FAISS warns below 39)
MIN_SAMPLE = 65_536  # PQ codebooks: 256 centroids x 256 points
DEFAULT_NPROBE = 64
MIN_PQ_COUNT = 39 * 256  # FAISS's least training points for 256 centroids
_SIZES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """'3G' -> 3 * 2**30; K/M/G/T are powers of 1024, a plain number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"memory size {text!r} is not a number with an optional K/M/G/T suffix")
    return int(float(match[1]) * _SIZES[match[2].upper()])


def default_nlist(count: int) -> int:
    """A power of two near sqrt(N), with at least SAMPLE_PER_CELL photos per cell."""
    nlist = 2 ** round(math.log2(max(1.0, math.sqrt(count))))
    while nlist > 1 and count < SAMPLE_PER_CELL * nlist:
        nlist //= 2
    return nlist


@dataclass(frozen=True)
class Recipe:
    """What a compressed index is made of (stored in the sidecar's `params`)."""

    kind: str
    nlist: int
    m: int  # PQ sub-vectors (bytes a photo); 0 for ivfsq8
    nprobe: int

    def factory(self, dims: int) -> str:
        ivf = f"IVF{self.nlist}"
        if self.kind == "ivfsq8":
            return f"{ivf},SQ8"
        if self.kind == "ivfpq":
            return f"{ivf},PQ{self.m}"
        return f"OPQ{self.m},{ivf},PQ{self.m}"

    def code_bytes(self, dims: int) -> int:
        return dims if self.kind == "ivfsq8" else self.m

    def memory(self, count: int, dims: int) -> int:
        """Bytes of the index: codes and ids, cell centroids, codebooks and rotation."""
        fixed = self.nlist * dims * 4 + (0 if self.kind == "ivfsq8" else 256 * dims * 4)
        fixed += dims * dims * 4 if self.kind == "opq" else 0
        return count * (self.code_bytes(dims) + ID_BYTES) + fixed


def flat_memory(count: int, dims: int) -> int:
    return count * dims * 4


def ivf_memory(count: int, dims: int) -> int:
    return count * (dims * 4 + ID_BYTES) + default_nlist(count) * dims * 4


def choose_auto(count: int, dims: int, budget: int | None) -> str:
    """The most exact kind whose index fits `budget` bytes: flat (up to AUTO_FLAT_MAX
    photos), IVF over float32 vectors, then ivfsq8, then opq with as many bytes as fit."""
    budget = budget or 2**62
    if count <= AUTO_FLAT_MAX and flat_memory(count, dims) <= budget:
        return "flat"
    if ivf_memory(count, dims) <= budget:
        return "ivf"
    if Recipe("ivfsq8", default_nlist(count), 0, 0).memory(count, dims) <= budget:
        return "ivfsq8"
    return "opq"


def plan_recipe(kind: str, count: int, dims: int, budget: int | None,
                nprobe: int = 0) -> Recipe:
    """Parameters of a compressed kind for `count` vectors of `dims` within `budget` bytes.

    PQ kinds take the most sub-vectors m (a divisor of dims, at most dims/2: sub-vectors of
    one dimension are a scalar quantizer, which ivfsq8 does faster) that fit. ValueError
    naming the least memory needed when nothing fits.
    """
    if kind not in COMPRESSED_KINDS:
        raise ValueError(f"{kind!r} is not a compressed kind ({', '.join(COMPRESSED_KINDS)})")
    nlist = default_nlist(count)
    nprobe = min(nlist, nprobe or DEFAULT_NPROBE)
    if kind != "ivfsq8" and count < MIN_PQ_COUNT:
        raise ValueError(f"{kind} trains 256 centroids per sub-vector and needs at least "
                         f"{MIN_PQ_COUNT} vectors, the gallery has {count}; use ivfsq8 or flat")
    if kind == "ivfsq8":
        recipe = Recipe(kind, nlist, 0, nprobe)
        candidates = [recipe]
    else:
        ms = [m for m in range(dims // 2, 0, -1) if dims % m == 0]
        if not ms:
            raise ValueError(f"{kind} needs dims >= 2, got {dims}")
        candidates = [Recipe(kind, nlist, m, nprobe) for m in ms]
    for recipe in candidates:
        if budget is None or recipe.memory(count, dims) <= budget:
            return recipe
    least = candidates[-1].memory(count, dims)
    raise ValueError(f"--max-index-memory {budget} bytes is too small for {kind} over {count} "
                     f"vectors of {dims} dims: it needs at least {least} bytes "
                     f"({least / 2**30:.2f} G)")


@dataclass(frozen=True)
class Block:
    """Rows start..start+count of the gallery's vectors, read by `load` ((count, dims),
    memory-mapped) when needed; `name` names its codes file."""

    name: str
    start: int
    count: int
    load: Callable[[], np.ndarray]


def plan_blocks(plan: ShardPlan) -> list[Block]:
    """The shards of a plan as blocks."""
    return [Block(s.stem, s.start, len(s.photos), partial(read_shard, plan, s))
            for s in plan.shards]


def blocks_key(recipe: Recipe, blocks: list[Block], dims: int, seed: int) -> str:
    """Names a build's work files: the recipe, the dims, the seed and the blocks' names."""
    digest = hashlib.sha256(repr((asdict(recipe), dims, seed)).encode())
    for block in blocks:
        digest.update(f"|{block.name}|{block.start}|{block.count}".encode())
    return digest.hexdigest()[:16]


def sample_vectors(blocks: list[Block], n: int, seed: int = 0) -> np.ndarray:
    """A seeded uniform sample (n, dims) of the vectors, read block by block."""
    total = sum(b.count for b in blocks)
    n = min(n, total)
    picks = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))
    parts = []
    for block in blocks:
        lo, hi = np.searchsorted(picks, [block.start, block.start + block.count])
        if hi > lo:
            parts.append(np.asarray(block.load()[picks[lo:hi] - block.start], dtype=np.float32))
    return np.concatenate(parts)


def train(recipe: Recipe, sample: np.ndarray) -> faiss.Index:
    """An empty trained index of `recipe` over inner product."""
    index = faiss.index_factory(sample.shape[1], recipe.factory(sample.shape[1]),
                                faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    if isinstance(ivf, faiss.IndexIVFPQ):
        # The factory turns on polysemous training (Hamming filtering, unused here): it was
        # 30 of the 31 s of training IVF128,PQ16 on 20,000 vectors.
        ivf.do_polysemous_training = False
    index.train(sample)
    faiss.extract_index_ivf(index).nprobe = recipe.nprobe
    return index


def build_compressed(recipe: Recipe, blocks: list[Block], dims: int, work: Path, seed: int = 0,
                     progress: bool = True,
                     on_block: Callable[[Block], None] | None = None) -> faiss.Index:
    """Train on a sample, encode each block (resumable), add the codes; returns the index.

    The trained index and each block's codes (cell number + code per vector) are kept in
    the folder `work` under a key of the recipe and the blocks, so a rerun after an
    interruption trains and encodes only what is missing. `on_block(block)` is called after
    each block is added (tests interrupt the build there).
    """
    key = blocks_key(recipe, blocks, dims, seed)
    trained_path = work / f"trained-{key}.faiss"
    if trained_path.is_file():
        index = faiss.read_index(str(trained_path))
        log.info("reusing the trained %s index %s", recipe.kind, trained_path)
    else:
        total = sum(b.count for b in blocks)
        n = min(total, max(MIN_SAMPLE, SAMPLE_PER_CELL * recipe.nlist))
        log.info("training %s on %d of %d vectors", recipe.factory(dims), n, total)
        index = train(recipe, sample_vectors(blocks, n, seed))
        atomic_write_bytes(faiss.serialize_index(index).tobytes(), trained_path)
    ivf = faiss.extract_index_ivf(index)
    bar = tqdm(total=sum(b.count for b in blocks), desc=f"encoding ({recipe.kind})",
               unit="vec", disable=not progress)
    for block in blocks:
        path = work / f"codes-{key}-{block.name}.npy"
        if not path.is_file():
            codes = index.sa_encode(np.ascontiguousarray(block.load(), dtype=np.float32))
            atomic_write_bytes(npy_bytes(codes), path)  # (count, cell bytes + code bytes) uint8
        codes = np.load(path)
        ivf.add_sa_codes(codes, np.arange(block.start, block.start + block.count,
                                          dtype=np.int64))
        bar.update(block.count)
        if on_block is not None:
            on_block(block)
    bar.close()
    index.ntotal = ivf.ntotal  # an OPQ wrapper counts only what was added through it
    return index


def build_from_shards(recipe: Recipe, plan: ShardPlan, seed: int = 0, progress: bool = True,
                      on_block: Callable[[Block], None] | None = None) -> faiss.Index:
    """`build_compressed` over the shards of `plan`, its work files in the shard folder."""
    return build_compressed(recipe, plan_blocks(plan), plan.dims, plan.folder, seed, progress,
                            on_block)


def remove_work_files(plan: ShardPlan) -> None:
    """Delete the trained indexes and codes of compressed builds (after the commit)."""
    for path in plan.folder.iterdir():
        if path.name.startswith(("trained-", "codes-", ".trained-", ".codes-")):
            path.unlink(missing_ok=True)
