"""From a gallery's embeddings to a committed index: the steps every build path shares.

The local (in-memory), sharded and Ray builds differ only in where the embeddings are kept
(arrays, or shard files on disk); given the same blocks they store the same vectors:
`assemble` smooths the gallery (`index.neighbours`, the model's rule), appends the hubness
correction's coordinate when the model has one (`index.hubness`), builds the index
of the first `dims` coordinates with its kind (`index.kinds`: chosen by size and memory
budget when "auto"), measures its recall@k against exact search at d = 16, 64 and the stored
dims unless the kind is exact, and commits the index, its sidecar and the photo table as a
new version of the index folder.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from index.blocks import Block, iter_arrays, sample_vectors, total
from index.gallery import Photo
from index.hubness import corrected_blocks, correction_of
from index.kinds import Kind, resolve
from index.neighbours import Store, memory_store, smooth_blocks
from index.search import exact_topk_blocks
from index.store import (
    INDEX_FILE,
    IndexWriter,
    Sidecar,
    current_version,
    new_sidecar,
    read_sidecar,
)
from index.table import PhotoTable
from training.cdk.model.smoothing import Smoothing

__all__ = ["RECALL_QUERIES", "Assembled", "BuildReport", "assemble", "blocks_recall",
           "report_dims", "check_dims"]

log = logging.getLogger(__name__)

RECALL_QUERIES = 1000  # gallery vectors used as queries for the recall measured at build
NO_SMOOTHING = Smoothing(k=0)


@dataclass(frozen=True)
class BuildReport:
    """What a build did (`index.build.build_index`, `index.sharded.build_sharded`)."""

    out: Path
    sidecar: Sidecar
    recall: dict[int, float]  # d -> recall@k against exact search (approximate kinds only)
    seconds: float
    from_cache: int = 0  # photos whose backbone features came from the feature cache
    embedded: int = 0  # photos embedded by this run (a sharded rerun reuses finished shards)
    shards: int = 0  # embedding shards on disk (0: the embeddings were kept in memory)
    index_bytes: int = 0  # size of index.faiss: what a server maps
    embed_seconds: float = 0.0  # of `seconds`, embedding the photos
    encoder: str = ""  # the photo encoder and its precision, e.g. "onnxruntime int8"
    skipped: dict | None = None  # gallery entries left out by the scan (index.gallery.Scan)
    failed: list | None = None  # (path, reason) of photos that did not decode


@dataclass(frozen=True)
class Assembled:
    out: Path
    sidecar: Sidecar
    recall: dict[int, float]  # d -> recall@k against exact search (approximate kinds only)
    index_bytes: int  # size of index.faiss: what a server maps


def check_dims(model, dims: int | None) -> int:
    """The stored dims: `dims`, default the embeddings' whole width."""
    dims = model.width if dims is None else dims
    if not 1 <= dims <= model.width:
        raise ValueError(f"--dims {dims} is outside [1, width {model.width}] of the model")
    return dims


def report_dims(dims: int) -> list[int]:
    """d = 16, 64 and the stored dims (those below `dims`)."""
    return sorted({d for d in (16, 64) if d < dims} | {dims})


def blocks_recall(kind: Kind, index: faiss.Index, blocks: list[Block], k: int,
                  dims_list: list[int], queries: np.ndarray | None = None,
                  n_queries: int = RECALL_QUERIES, seed: int = 0) -> dict[int, float]:
    """Recall@k of `index` (searched by its kind) against exact search over the blocks, per
    prefix d. `queries` (Q, >= max d) default to a seeded sample of the blocks' vectors."""
    if queries is None:
        queries = sample_vectors(blocks, n_queries, seed=seed + 1)
    k = min(k, total(blocks))
    out = {}
    for d in dims_list:
        q = np.ascontiguousarray(queries[:, :d], dtype=np.float32)
        _, truth = exact_topk_blocks(iter_arrays(blocks, d), q, k)
        _, found = kind.search(index, q, k)
        hits = sum(len(set(t) & set(f[f >= 0])) for t, f in zip(truth, found, strict=True))
        out[d] = hits / (len(q) * k)
    return out


def assemble(writer: IndexWriter, model, root: Path,
             tables: Iterable[PhotoTable | Iterable[Photo]], blocks: list[Block], dims: int,
             kind: str = "auto", budget: int | None = None, nprobe: int = 0,
             smoothing: Smoothing = NO_SMOOTHING, recall_k: int = 10,
             store: Store = memory_store, work: Path | None = None,
             progress: bool = False, photo_views: int = 1) -> Assembled:
    """Smooth, index, measure and commit the gallery whose embeddings (N, width) are
    `blocks` (its photos in `photo_views`) and whose rows are the `tables` one after the
    other; returns what was written.
    `store` keeps the smoothed blocks, `work` the code kinds' resumable work files."""
    count = total(blocks)
    hub = correction_of(model, dims)
    stored = dims + (1 if hub else 0)  # the penalty's coordinate after the embedding's
    chosen, params = resolve(kind, count, stored, budget, nprobe)
    log.info("index kind %s %s for %d vectors of %d dims", chosen.name, params, count, stored)
    smoothed = smooth_blocks(blocks, smoothing, store, budget=budget)
    if hub:
        smoothed = corrected_blocks(smoothed, model.hubness_sample(), hub, store,
                                    f"{model.sha256}|{smoothing.as_dict()}")
    index = chosen.build(smoothed, stored, params, work, progress=progress)
    recall = {} if chosen.exact else blocks_recall(chosen, index, smoothed, recall_k,
                                                   report_dims(stored))
    sidecar = new_sidecar(
        model, dims, count, chosen.name, root, params=params,
        recall={"k": recall_k, "queries": "gallery vectors",
                "by_dims": {str(d): r for d, r in recall.items()}} if recall else {},
        smoothing=smoothing.as_dict() if smoothing.active else {},
        hubness=hub.as_dict() if hub else {},
        photo_views=photo_views,
    )
    out = writer.commit(index, sidecar, *tables)
    del index
    size = (current_version(out) / INDEX_FILE).stat().st_size
    return Assembled(out, read_sidecar(out), recall, size)  # with the files it lists
