"""Build an index through embedding shards: Ray or local embedding, any kind, memory budget.

`python -m index.build` comes here when it is given `--engine ray`, a compressed `--kind`
(`index.compressed`) or `--max-index-memory`. The photos are embedded into shards
(`index.shards`: only the shards not finished by an earlier, interrupted run), the kind is
chosen from the budget when it is `auto`, the index is built from the shards (the compressed
kinds stream them; flat / ivf / hnsw load them, which needs their size in memory), its recall@k
against exact search is measured at d = 16, 64 and the stored dims, and it is committed as a
new version of OUT (`index.store`) under OUT's writer lock. Nothing is committed before every
shard is finished and the index is complete, so a reader never sees a partial index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from index.compressed import (
    COMPRESSED_KINDS,
    Block,
    build_from_shards,
    choose_auto,
    parse_bytes,
    plan_blocks,
    plan_recipe,
    remove_work_files,
    sample_vectors,
)
from index.gallery import scan_gallery
from index.kinds import KINDS
from index.search import exact_topk_blocks, recall_of
from index.shards import (
    DEFAULT_SHARD_SIZE,
    embed_local,
    load_vectors,
    missing_shards,
    plan_shards,
    remove_stale,
)
from index.store import (
    INDEX_FILE,
    SHARDS_DIR,
    IndexWriter,
    Sidecar,
    check_replaceable,
    current_version,
    new_sidecar,
)
from training.cdk.model.embedder import Embedder

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")
RECALL_QUERIES = 1000


@dataclass(frozen=True)
class ShardedReport:
    out: Path
    sidecar: Sidecar
    recall: dict[int, float]  # d -> recall@k against exact search (approximate kinds only)
    seconds: float
    embedded: int  # photos embedded by this run (the others were in finished shards)
    shards: int
    index_bytes: int  # size of index.faiss: what a server maps


def report_dims(dims: int) -> list[int]:
    """d = 16, 64 and the stored dims (those below `dims`)."""
    return sorted({d for d in (16, 64) if d < dims} | {dims})


def blocks_recall(index: faiss.Index, blocks: list[Block], stored: int, k: int,
                  dims_list: list[int], queries: np.ndarray | None = None,
                  n_queries: int = RECALL_QUERIES, seed: int = 0) -> dict[int, float]:
    """Recall@k of `index` against exact search over the blocks, per prefix d. `queries`
    (Q, stored) default to a seeded sample of the blocks' own vectors (as
    `index.search.recall_at_k` draws them from the gallery)."""
    if queries is None:
        queries = sample_vectors(blocks, n_queries, seed=seed + 1)
    count = sum(b.count for b in blocks)
    out = {}
    for d in dims_list:
        q = np.ascontiguousarray(queries[:, :d])
        _, truth = exact_topk_blocks(((b.start, b.load()[:, :d]) for b in blocks), q, k)
        out[d] = recall_of(index, q, truth, stored, min(k, count))
    return out


def build_sharded(
    embedder: Embedder,
    photos: str | Path,
    out: str | Path,
    checkpoint: str | Path,
    dims: int | None = None,
    kind: str = "auto",
    batch_size: int = 32,
    recall_k: int = 10,
    progress: bool = True,
    engine: str = "local",
    address: str | None = None,
    ray_actors: int = 0,
    ray_cpus: int = 2,
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_index_memory: str | None = None,
    nprobe: int = 0,
    device: str | None = None,
    load: Callable[[], Embedder] | None = None,
) -> ShardedReport:
    """Embed `photos` into shards under OUT/shards (engine "local" or "ray"), build the
    index from them and commit it to `out`. `load` builds the embedder in each Ray actor
    (default: the checkpoint file on `device`). ValueError for a budget no kind fits."""
    start = time.perf_counter()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    dims = embedder.width if dims is None else dims
    if not 1 <= dims <= embedder.width:
        raise ValueError(f"--dims {dims} is outside [1, width {embedder.width}] of the checkpoint")
    budget = parse_bytes(max_index_memory) if max_index_memory else None
    if kind != "auto" and kind not in KINDS and kind not in COMPRESSED_KINDS:
        raise ValueError(f"unknown index kind {kind!r}")
    out = Path(out).absolute()
    check_replaceable(out)
    root, gallery = scan_gallery(photos)
    with IndexWriter(out) as writer:
        plan = plan_shards(out / SHARDS_DIR, root, gallery, dims, embedder.checkpoint_sha256,
                           shard_size)
        todo = missing_shards(plan)
        log.info("%d of %d shards to embed (%s engine)", len(todo), len(plan.shards), engine)
        if engine == "ray":
            from index.ray_engine import CheckpointLoader, embed_ray

            embedded = embed_ray(plan, todo, load or CheckpointLoader(checkpoint, device),
                                 batch_size, address, ray_actors, ray_cpus, progress)
        else:
            embedded = embed_local(embedder, plan, todo, batch_size, progress)
        count = plan.count
        kind = choose_auto(count, dims, budget) if kind == "auto" else kind
        params: dict = {}
        if kind in COMPRESSED_KINDS:
            recipe = plan_recipe(kind, count, dims, budget, nprobe)
            index = build_from_shards(recipe, plan, progress=progress)
            params = asdict(recipe)
        else:
            vectors = load_vectors(plan)  # (N, dims): these kinds hold every vector
            index = KINDS[kind](vectors)
            del vectors
            if kind == "ivf":
                params = {"nlist": int(index.nlist), "nprobe": int(index.nprobe)}
        recall = {}
        if kind != "flat":
            recall = blocks_recall(index, plan_blocks(plan), dims, recall_k, report_dims(dims))
        sidecar = new_sidecar(
            embedder, checkpoint, dims, count, kind, root, params=params,
            recall={"k": recall_k, "queries": "gallery vectors",
                    "by_dims": {str(d): r for d, r in recall.items()}} if recall else {},
        )
        writer.commit(index, sidecar, *(s.photos for s in plan.shards))  # table by shard
        del index
        remove_work_files(plan)
        remove_stale(plan)
    size = (current_version(out) / INDEX_FILE).stat().st_size
    return ShardedReport(out, sidecar, recall, time.perf_counter() - start, embedded,
                         len(plan.shards), size)


def print_report(report: ShardedReport, recall_k: int) -> None:
    s = report.sidecar
    print(f"index: {report.out}")
    print(f"  {s.count} photos, kind={s.kind}, dims={s.dims} of L={s.L}, backbone={s.backbone}")
    if s.params:
        print(f"  params {s.params}")
    print(f"  {report.shards} shards, {report.embedded} photos embedded by this run; "
          f"index file {report.index_bytes / 2**20:.1f} MiB")
    print(f"  checkpoint sha256 {s.checkpoint_sha256[:16]}..., built in {report.seconds:.1f}s")
    for d, r in report.recall.items():
        print(f"  recall@{recall_k} vs exact at d={d}: {r:.4f}")
    print(f"serve it: python -m service --index {report.out}")
