"""Build an index through embedding shards on disk: Ray or local embedding, any kind, a
memory budget, resumable.

`python -m index.build` comes here when it is given `--engine ray`, a code `--kind`
(`index.kinds.codes`, `index.kinds.mixed`) or `--max-index-memory`. The photos are embedded
into shards (`index.shards`: only the shards not finished by an earlier, interrupted run),
then `index.assemble` smooths them (each round's vectors kept as files next to the shards),
chooses the kind from the budget when it is "auto", builds the index from the shards (the
code kinds stream them; the float32 kinds load them, which needs their size in memory),
measures its recall and commits it as a new version of OUT (`index.store`) under OUT's writer
lock. Nothing is committed before every shard is finished and the index is complete, so a
reader never sees a partial index; the smoothing and encoding work files go after the commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from index.assemble import BuildReport, assemble, check_dims
from index.embed import photo_encoder
from index.gallery import scan_gallery
from index.kinds import parse_bytes
from index.neighbours import folder_store, model_smoothing
from index.shards import (
    DEFAULT_SHARD_SIZE,
    embed_local,
    missing_shards,
    plan_blocks,
    plan_shards,
    remove_stale,
    shard_failures,
)
from index.store import SHARDS_DIR, IndexWriter, check_replaceable
from training.cdk.model.smoothing import Smoothing

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")


def build_sharded(
    model,
    photos: str | Path,
    out: str | Path,
    dims: int | None = None,
    kind: str = "auto",
    batch_size: int = 32,
    recall_k: int = 10,
    progress: bool = True,
    feature_cache: str | Path | None = None,
    workers: int = 0,
    smoothing: Smoothing | None = None,
    encoder: str = "auto",
    precision: str = "auto",
    threads: int = 2,
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_index_memory: str | None = None,
    nprobe: int = 0,
    engine: str = "local",
    address: str | None = None,
    ray_actors: int = 0,
    device: str | None = None,
    load: Callable | None = None,
    photo_views: int = 1,
) -> BuildReport:
    """Embed `photos` into shards under OUT/shards (engine "local" or "ray"), build the
    index from them and commit it to `out`; the other arguments as `index.build.build_index`
    (which comes here for large galleries).
    Ray: `threads` CPUs for a local Ray, `load` opens the model in each actor (default:
    the bundle's folder, on `device`). ValueError for a budget no kind fits."""
    start = time.perf_counter()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    dims = check_dims(model, dims)
    budget = parse_bytes(max_index_memory) if max_index_memory else None
    if smoothing is None:
        smoothing = model_smoothing(model)
    out = Path(out).absolute()
    check_replaceable(out)
    scan = scan_gallery(photos)
    log.info("gallery %s: %s", scan.root, scan.summary())
    with IndexWriter(out) as writer:
        # The precision and views are part of the shards' keys (auto: the bundle's choice,
        # for the Ray actors too).
        enc = photo_encoder(model, threads, encoder, precision, device, photo_views)
        plan = plan_shards(out / SHARDS_DIR, scan.root, scan.photos, model.width,
                           model.sha256, shard_size, enc.precision, photo_views)
        todo = missing_shards(plan)
        t0 = time.perf_counter()
        log.info("%d of %d shards to embed (%s engine)", len(todo), len(plan.shards), engine)
        if engine == "ray":
            from index.ray_engine import ModelLoader, embed_ray

            embedded, cached = embed_ray(
                plan, todo, load or ModelLoader(model.path), out,
                batch_size, feature_cache, encoder, address, ray_actors, threads, progress,
                enc.precision, device)
        else:
            embedded, cached = embed_local(model, enc, plan, todo, batch_size,
                                           feature_cache, workers, progress)
        embed_s = time.perf_counter() - t0
        blocks, tables = plan_blocks(plan)
        if not sum(len(t) for t in tables):
            raise ValueError(f"none of the {plan.count} photos of {str(photos)!r} decoded")
        built = assemble(writer, model, scan.root, tables, blocks, dims, kind, budget, nprobe,
                         smoothing, recall_k, store=folder_store(plan.folder), work=plan.folder,
                         progress=progress, photo_views=photo_views)
        failed = shard_failures(plan)
        remove_stale(plan)  # work files and shards of other keys
    return BuildReport(out, built.sidecar, built.recall, time.perf_counter() - start, cached,
                       embedded, len(plan.shards), built.index_bytes, embed_s,
                       f"{enc.name} {enc.precision}", scan.skipped, failed)
