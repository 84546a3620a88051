"""Embedding shards: a gallery's vectors on disk in pieces that are written once and reused.

    OUT/shards/shard-000012-<key>.npy    float32 (n, width), the embeddings of photos start..start+n
    OUT/shards/shard-000012-<key>.json   the rows of those photos ({"id", "class", "path"}), the
                                         shard's place and the byte size of its .npy

The gallery (sorted by class and file) is cut into consecutive shards of `shard_size` photos.
A shard's key hashes what its vectors depend on: the checkpoint's sha256, the embeddings'
width, the photo encoder's precision when it is int8, its place, and each of its photos' id,
class, path, byte size and modification time.
Shards hold the whole embeddings (gallery smoothing finds neighbours with all coordinates);
the index stores their first `dims`. A shard is
finished when its .json exists and its .npy has the recorded size; both are written atomically
(.npy first), so a writer killed at any moment leaves finished shards and temporaries, never a
half shard. A rerun embeds only the shards that are not finished, with either engine (this
process, or Ray actors: `index.ray_engine`), each shard by `index.embed.embed_slice` as the
in-memory build embeds the same slice; shards of other keys are removed after the index they
fed is committed. Shards are read memory-mapped, one at a time (`plan_blocks`), so building
an index from them never holds all vectors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from index.blocks import Block, npy_bytes
from index.embed import PhotoEncoder, embed_slice
from index.gallery import Photo
from training.cdk.model.embedder import Embedder
from training.cli import UserError
from training.files import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)

SHARD_FORMAT = 2
DEFAULT_SHARD_SIZE = 10_000  # photos: 20 MB of vectors 512 wide


class ShardError(UserError):
    """A shard on disk disagrees with the plan (edited or written by other code)."""


@dataclass(frozen=True)
class Shard:
    """One planned shard: photos[start:start+len(photos)] of the gallery."""

    number: int
    start: int
    key: str
    photos: tuple[Photo, ...]

    @property
    def stem(self) -> str:
        return f"shard-{self.number:06d}-{self.key}"


@dataclass(frozen=True)
class ShardPlan:
    """The shards of one gallery for one checkpoint, in a folder."""

    folder: Path
    root: Path  # photo paths are relative to it
    width: int  # the embeddings' width
    checkpoint_sha256: str
    shards: tuple[Shard, ...]

    @property
    def count(self) -> int:
        return sum(len(s.photos) for s in self.shards)

    def npy(self, shard: Shard) -> Path:
        return self.folder / f"{shard.stem}.npy"

    def meta(self, shard: Shard) -> Path:
        return self.folder / f"{shard.stem}.json"


def _shard_key(checkpoint_sha256: str, width: int, number: int, start: int, root: Path,
               photos: list[Photo], precision: str = "fp32") -> str:
    tag = "" if precision == "fp32" else f"|{precision}"  # float32 keys as they always were
    digest = hashlib.sha256(
        f"{SHARD_FORMAT}|{checkpoint_sha256}{tag}|{width}|{number}|{start}".encode())
    for p in photos:
        st = os.stat(root / p.path)
        digest.update(f"|{p.id}|{p.cls}|{p.path}|{st.st_size}|{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def plan_shards(folder: str | Path, root: Path, photos: list[Photo], width: int,
                checkpoint_sha256: str, shard_size: int = DEFAULT_SHARD_SIZE,
                precision: str = "fp32") -> ShardPlan:
    """Cut `photos` (the order of `index.gallery.scan_gallery`) into shards of `shard_size`;
    `precision`: the photo encoder's (fp32 or int8), so shards of the other one are not
    reused."""
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size} must be >= 1")
    shards = []
    for number, start in enumerate(range(0, len(photos), shard_size)):
        chunk = photos[start : start + shard_size]
        key = _shard_key(checkpoint_sha256, width, number, start, root, chunk, precision)
        shards.append(Shard(number, start, key, tuple(chunk)))
    return ShardPlan(Path(folder), root, width, checkpoint_sha256, tuple(shards))


def write_shard(plan: ShardPlan, shard: Shard, vectors: np.ndarray) -> None:
    """Write one shard's vectors (n, width), then its .json; each file atomically."""
    if vectors.shape != (len(shard.photos), plan.width):
        raise ValueError(f"shard {shard.number}: vectors {vectors.shape}, expected "
                         f"{(len(shard.photos), plan.width)}")
    data = npy_bytes(vectors.astype(np.float32, copy=False))
    atomic_write_bytes(data, plan.npy(shard))
    meta = {"format": SHARD_FORMAT, "number": shard.number, "start": shard.start,
            "key": shard.key, "width": plan.width, "checkpoint_sha256": plan.checkpoint_sha256,
            "npy_bytes": len(data),
            "photos": [{"id": p.id, "class": p.cls, "path": p.path} for p in shard.photos]}
    atomic_write_text(json.dumps(meta) + "\n", plan.meta(shard))


def is_finished(plan: ShardPlan, shard: Shard) -> bool:
    """Both files are there and the .npy has the size the .json records."""
    try:
        meta = json.loads(plan.meta(shard).read_text(encoding="utf-8"))
        return plan.npy(shard).stat().st_size == meta["npy_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def missing_shards(plan: ShardPlan) -> list[Shard]:
    return [s for s in plan.shards if not is_finished(plan, s)]


def read_shard(plan: ShardPlan, shard: Shard) -> np.ndarray:
    """The vectors (n, width) of a finished shard, memory-mapped read only; ShardError when
    its files disagree with the plan."""
    path = plan.meta(shard)
    meta = json.loads(path.read_text(encoding="utf-8"))
    rows = [Photo(id=r["id"], cls=r["class"], path=r["path"]) for r in meta["photos"]]
    if (meta.get("format"), meta.get("width"), meta["checkpoint_sha256"], meta["start"]) != (
            SHARD_FORMAT, plan.width, plan.checkpoint_sha256, shard.start) or (
            tuple(rows) != shard.photos):
        raise ShardError(f"{str(path)!r} does not describe shard {shard.number} of this gallery "
                         f"(key {shard.key}); delete it and rerun")
    vectors = np.load(plan.npy(shard), mmap_mode="r")
    if vectors.shape != (len(shard.photos), plan.width) or vectors.dtype != np.float32:
        raise ShardError(f"{str(plan.npy(shard))!r} holds {vectors.dtype} {vectors.shape}, "
                         f"expected float32 {(len(shard.photos), plan.width)}; delete it and "
                         "rerun")
    return vectors


def iter_shards(plan: ShardPlan) -> Iterator[tuple[Shard, np.ndarray]]:
    """(shard, memory-mapped vectors (n, width)) in gallery order; every shard must be done."""
    for shard in plan.shards:
        yield shard, read_shard(plan, shard)


def plan_blocks(plan: ShardPlan) -> list[Block]:
    """The finished shards of a plan as blocks, each read (memory-mapped) when loaded."""
    return [Block(s.stem, s.start, len(s.photos), partial(read_shard, plan, s))
            for s in plan.shards]


def load_vectors(plan: ShardPlan) -> np.ndarray:
    """All vectors (N, width) in one array (tests; the build reads blocks)."""
    out = np.empty((plan.count, plan.width), dtype=np.float32)
    for shard, vectors in iter_shards(plan):
        out[shard.start : shard.start + len(vectors)] = vectors
    return out


def remove_stale(plan: ShardPlan) -> int:
    """Delete every file of the shard folder but the plan's shards: shards of other keys,
    work files of the build (smoothed rounds, codes), temporaries of killed writers."""
    keep = {f"{s.stem}{ext}" for s in plan.shards for ext in (".npy", ".json")}
    removed = 0
    for path in plan.folder.iterdir():
        if path.name not in keep and path.is_file():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def embed_local(embedder: Embedder, encoder: PhotoEncoder, plan: ShardPlan, shards: list[Shard],
                batch_size: int = 32, cache_dir: str | Path | None = None, workers: int = 0,
                progress: bool = True) -> tuple[int, int]:
    """Embed `shards` in this process, writing each as it is done; returns (photos embedded,
    how many of them came from the feature cache)."""
    plan.folder.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=sum(len(s.photos) for s in shards), desc="embedding shards", unit="img",
               disable=not progress)
    cached = 0
    for shard in shards:
        vectors, hits = embed_slice(embedder, encoder, plan.root, list(shard.photos), cache_dir,
                                    batch_size, workers)
        write_shard(plan, shard, vectors)
        cached += hits
        bar.update(len(shard.photos))
    bar.close()
    return sum(len(s.photos) for s in shards), cached
