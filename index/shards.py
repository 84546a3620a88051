"""Embedding shards: a gallery's vectors on disk in pieces that are written once and reused.

    OUT/shards/shard-000012-<key>.npy    float32 (n, width), the embeddings of photos start..start+n
    OUT/shards/shard-000012-<key>.json   the rows of those photos ({"id", "class", "path"}), the
                                         photos that failed to decode, the shard's place and
                                         the byte size of its .npy

The gallery (sorted by class and file) is cut into consecutive shards of `shard_size` photos.
A shard's key hashes what its vectors depend on: the model bundle's sha256, the embeddings'
width, the photo encoder's precision and views, its place, and each of its photos' id, class, path,
byte size and modification time. A photo of the shard that fails to decode is listed in its
.json and has no row: the index's rows are the shards' rows one after the other.
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from index.blocks import Block, npy_bytes
from index.embed import Embedded, PhotoEncoder, embed_slice
from index.gallery import Photo
from training.cli import UserError
from training.files import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)

SHARD_FORMAT = 3
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
    """The shards of one gallery for one model, in a folder."""

    folder: Path
    root: Path  # photo paths are relative to it
    width: int  # the embeddings' width
    model_sha256: str
    shards: tuple[Shard, ...]
    views: int = 1  # each photo alone, or averaged with its mirror image (index.embed.VIEWS)

    @property
    def count(self) -> int:
        return sum(len(s.photos) for s in self.shards)

    def npy(self, shard: Shard) -> Path:
        return self.folder / f"{shard.stem}.npy"

    def meta(self, shard: Shard) -> Path:
        return self.folder / f"{shard.stem}.json"


def _shard_key(model_sha256: str, width: int, number: int, start: int, root: Path,
               photos: list[Photo], precision: str = "fp32", views: int = 1) -> str:
    digest = hashlib.sha256(
        f"{SHARD_FORMAT}|{model_sha256}|{precision}|{views}|{width}|{number}|{start}".encode())
    for p in photos:
        st = os.stat(root / p.path)
        digest.update(f"|{p.id}|{p.cls}|{p.path}|{st.st_size}|{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def plan_shards(folder: str | Path, root: Path, photos: list[Photo], width: int,
                model_sha256: str, shard_size: int = DEFAULT_SHARD_SIZE,
                precision: str = "fp32", views: int = 1) -> ShardPlan:
    """Cut `photos` (the order of `index.gallery.scan_gallery`) into shards of `shard_size`;
    `precision` and `views`: the photo encoder's (fp32 or int8; index.embed.VIEWS), so
    shards of another one are not reused."""
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size} must be >= 1")
    shards = []
    for number, start in enumerate(range(0, len(photos), shard_size)):
        chunk = photos[start : start + shard_size]
        key = _shard_key(model_sha256, width, number, start, root, chunk, precision, views)
        shards.append(Shard(number, start, key, tuple(chunk)))
    return ShardPlan(Path(folder), root, width, model_sha256, tuple(shards), views)


def _rows(photos) -> list[dict]:
    return [{"id": p.id, "class": p.cls, "path": p.path} for p in photos]


def write_shard(plan: ShardPlan, shard: Shard, embedded: Embedded) -> None:
    """Write one shard's vectors (n, width) of the photos that decoded, then its .json (with
    the ones that did not); each file atomically."""
    vectors = embedded.vectors
    left_out = {p.id for p, _ in embedded.failed}
    if (vectors.shape != (len(embedded.photos), plan.width)
            or list(embedded.photos) != [p for p in shard.photos if p.id not in left_out]):
        raise ValueError(f"shard {shard.number}: vectors {vectors.shape} of "
                         f"{len(embedded.photos)} photos do not fit its {len(shard.photos)} "
                         f"photos ({len(left_out)} failed)")
    data = npy_bytes(vectors.astype(np.float32, copy=False))
    atomic_write_bytes(data, plan.npy(shard))
    meta = {"format": SHARD_FORMAT, "number": shard.number, "start": shard.start,
            "key": shard.key, "width": plan.width, "model_sha256": plan.model_sha256,
            "npy_bytes": len(data), "photos": _rows(embedded.photos),
            "failed": [{**_rows([p])[0], "reason": why} for p, why in embedded.failed]}
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


def _meta(plan: ShardPlan, shard: Shard) -> dict:
    """A finished shard's .json, checked against the plan: ShardError when it disagrees."""
    path = plan.meta(shard)
    meta = json.loads(path.read_text(encoding="utf-8"))
    rows = [Photo(id=r["id"], cls=r["class"], path=r["path"]) for r in meta["photos"]]
    failed = {r["id"] for r in meta.get("failed", [])}
    if (meta.get("format"), meta.get("width"), meta.get("model_sha256"), meta["start"]) != (
            SHARD_FORMAT, plan.width, plan.model_sha256, shard.start) or (
            rows != [p for p in shard.photos if p.id not in failed]):
        raise ShardError(f"{str(path)!r} does not describe shard {shard.number} of this gallery "
                         f"(key {shard.key}); delete it and rerun")
    return {**meta, "rows": rows}


def shard_photos(plan: ShardPlan, shard: Shard) -> list[Photo]:
    """The photos of a finished shard that have a row (those that decoded)."""
    return _meta(plan, shard)["rows"]


def shard_failures(plan: ShardPlan) -> list[tuple[str, str]]:
    """(path, reason) of every photo of the plan's finished shards that did not decode."""
    return [(r["path"], r["reason"]) for s in plan.shards
            for r in json.loads(plan.meta(s).read_text(encoding="utf-8")).get("failed", [])]


def read_shard(plan: ShardPlan, shard: Shard) -> np.ndarray:
    """The vectors (n, width) of a finished shard, memory-mapped read only; ShardError when
    its files disagree with the plan."""
    n = len(_meta(plan, shard)["rows"])
    vectors = np.load(plan.npy(shard), mmap_mode="r")
    if vectors.shape != (n, plan.width) or vectors.dtype != np.float32:
        raise ShardError(f"{str(plan.npy(shard))!r} holds {vectors.dtype} {vectors.shape}, "
                         f"expected float32 {(n, plan.width)}; delete it and rerun")
    return vectors


def plan_blocks(plan: ShardPlan) -> tuple[list[Block], list[list[Photo]]]:
    """The finished shards of a plan as blocks, each read (memory-mapped) when loaded, and
    their photos: row r of the index is the r-th row of the shards one after the other."""
    blocks, tables, start = [], [], 0
    for s in plan.shards:
        rows = shard_photos(plan, s)
        blocks.append(Block(s.stem, start, len(rows), partial(read_shard, plan, s)))
        tables.append(rows)
        start += len(rows)
    return blocks, tables


def load_vectors(plan: ShardPlan) -> np.ndarray:
    """All vectors (N, width) in one array (tests; the build reads blocks)."""
    blocks, _ = plan_blocks(plan)
    return np.concatenate([np.asarray(b.load()) for b in blocks]) if blocks else \
        np.zeros((0, plan.width), np.float32)


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


def embed_local(model, encoder: PhotoEncoder, plan: ShardPlan, shards: list[Shard],
                batch_size: int = 32, cache_dir: str | Path | None = None, workers: int = 0,
                progress: bool = True) -> tuple[int, int]:
    """Embed `shards` in this process with `encoder` (in the plan's views), writing each as
    it is done; returns (photos embedded, how many of them came from the feature cache)."""
    plan.folder.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=sum(len(s.photos) for s in shards), desc="embedding shards", unit="img",
               disable=not progress)
    cached = 0
    for shard in shards:
        part = embed_slice(model, encoder, plan.root, list(shard.photos), cache_dir,
                           batch_size, workers, views=plan.views)
        write_shard(plan, shard, part)
        cached += part.from_cache
        bar.update(len(shard.photos))
    bar.close()
    return sum(len(s.photos) for s in shards), cached
