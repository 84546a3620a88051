"""Build a retrieval index from a checkpoint and a photo folder.

    python -m index.build --checkpoint runs/cdk/checkpoint.pt \
        --photos ../shared/data/sketchy-mini --out runs/index

Embeds every photo with the checkpoint's photo side, keeps the top `--dims` modes (default
all L) and writes an exact inner-product index, or an approximate one for large galleries
(`--kind`, or chosen by size) with its recall against exact search printed. `--device`
defaults to CUDA when present; `--append` adds the new photos to the index at `--out`.
`--engine ray`, a compressed `--kind` (ivfsq8, ivfpq, opq) or `--max-index-memory` build
through resumable embedding shards instead (`index.sharded`).

Photos whose frozen-backbone features training cached (`--feature-cache`, by default the
checkpoint's `cache_dir`; `none` turns reuse off) only go through the photo head; a
fine-tuned checkpoint embeds every photo with its own backbone. The other photos are decoded
by `--workers` DataLoader processes (0: this one).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.add import append_photos, print_append
from index.compressed import COMPRESSED_KINDS
from index.gallery import cached_features, embed_photos, feature_cache_dir, scan_gallery
from index.kinds import KINDS, choose_kind
from index.search import recall_at_k
from index.sharded import ENGINES, build_sharded, print_report
from index.smoothing import checkpoint_smoothing, smooth_vectors
from index.store import IndexWriter, Sidecar, check_replaceable, new_sidecar
from index.threads import set_threads
from training import cli
from training.allocator import tune_allocator
from training.cdk.model.embedder import Embedder
from training.cdk.model.smoothing import Smoothing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildConfig:
    checkpoint: str = ""  # training.cdk checkpoint.pt
    photos: str = ""  # folder of <class>/<photo>, or a paired folder
    out: str = ""  # index folder to write (replaced atomically)
    dims: int | None = None  # stored modes; None: all L
    kind: str = "auto"  # auto | flat | ivf | hnsw
    batch_size: int = 32
    recall_k: int = 10
    device: str | None = None  # torch device; None: CUDA when present, else CPU
    threads: int = 2  # CPU threads of torch and FAISS
    append: bool = False  # add new photos to the index at --out instead of rebuilding
    feature_cache: str | None = None  # training's feature cache; None: the checkpoint's; "none"
    workers: int = 1  # DataLoader processes decoding photos; 0: the main one
    progress: bool = True
    # Gallery smoothing (training.cdk.model.smoothing) of the stored photo vectors; None: the
    # checkpoint's values (training's --smooth-*); --smooth-k 0 stores the plain embeddings.
    # Sharded builds do not smooth.
    smooth_k: int | None = None
    smooth_weight: float | None = None
    smooth_rounds: int | None = None
    # Sharded builds (index.sharded): taken when --engine ray, a compressed --kind or
    # --max-index-memory is given.
    engine: str = "local"  # local | ray: where photos are embedded into OUT/shards
    address: str | None = None  # Ray cluster address; None: a local Ray on --threads CPUs
    ray_actors: int = 0  # Ray actors holding the embedder; 0: one per GPU, else one per CPU
    shard_size: int = 10_000  # photos per embedding shard
    max_index_memory: str | None = None  # e.g. 3G: auto picks the most exact kind that fits
    nprobe: int = 0  # cells probed per query by the compressed kinds; 0: 64


@dataclass(frozen=True)
class BuildReport:
    out: Path
    sidecar: Sidecar
    recall: dict[int, float]  # d -> recall@k against exact search (approximate kinds only)
    seconds: float
    from_cache: int = 0  # photos whose backbone features came from the feature cache


def prefix_dims(stored: int) -> list[int]:
    """The d at which recall is reported: powers of two below `stored`, and `stored`."""
    ds = [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if d < stored]
    return [*ds[-3:], stored]


def build_index(
    embedder: Embedder,
    photos: str | Path,
    out: str | Path,
    checkpoint: str | Path,
    dims: int | None = None,
    kind: str = "auto",
    batch_size: int = 32,
    recall_k: int = 10,
    progress: bool = True,
    feature_cache: str | Path | None = None,
    workers: int = 0,
    smoothing: Smoothing | None = None,
) -> BuildReport:
    """Embed the gallery `photos` and write an index folder at `out` (the new version
    replaces the current one atomically; another writer of `out` is an IndexLockedError).
    `feature_cache`: training's feature cache folder to reuse photo features from (None:
    none); `workers`: DataLoader processes decoding the other photos (0: this one);
    `smoothing`: of the stored vectors (None: the checkpoint's)."""
    start = time.perf_counter()
    dims = embedder.width if dims is None else dims
    if not 1 <= dims <= embedder.width:
        raise ValueError(f"--dims {dims} is outside [1, width {embedder.width}] of the checkpoint")
    if smoothing is None:
        smoothing = checkpoint_smoothing(embedder.config)
    check_replaceable(Path(out).absolute())  # fail before minutes of embedding, not after
    root, gallery = scan_gallery(photos)
    with IndexWriter(out) as writer:  # held while embedding: a second writer fails at once
        kind = choose_kind(len(gallery), kind)
        cached = cached_features(embedder, root, gallery, feature_cache)
        # smoothing finds each photo's neighbours with all L modes (the rule acts on each
        # coordinate alike, so the stored d-prefix is the L-dim smoothed vector's prefix,
        # the gallery a `dims=d` query of a full index sees); then the top `dims` are kept
        width = embedder.width if smoothing.active else dims
        vectors = embed_photos(embedder, root, gallery, width, batch_size, progress, cached,
                               workers)  # (N, width)
        vectors = np.ascontiguousarray(smooth_vectors(vectors, smoothing)[:, :dims])
        index = KINDS[kind](vectors)
        recall = {}
        if kind != "flat":
            recall = {d: recall_at_k(index, vectors, k=recall_k, dims=d)
                      for d in prefix_dims(dims)}
        sidecar = new_sidecar(embedder, checkpoint, dims, len(gallery), kind, root,
                              smoothing=smoothing.as_dict() if smoothing.active else None)
        path = writer.commit(index, sidecar, gallery)
    return BuildReport(path, sidecar, recall, time.perf_counter() - start, len(cached[0]))


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    """One dashed flag per BuildConfig field (training.cli); --checkpoint, --photos and
    --out are required."""
    parser = cli.build_parser(
        BuildConfig,
        prog="python -m index.build",
        description=__doc__,
        choices={"kind": ["auto", *KINDS, *COMPRESSED_KINDS], "engine": list(ENGINES)},
        required=("checkpoint", "photos", "out"),
    )
    return cli.parse(parser, BuildConfig, argv)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    tune_allocator()
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    embedder = Embedder.from_checkpoint(cfg.checkpoint, device=cfg.device)
    cache = feature_cache_dir(cfg.feature_cache, embedder)
    if cfg.append:
        print_append(append_photos(embedder, cfg.out, cfg.photos, cfg.batch_size, cfg.progress,
                                   cache, cfg.workers))
        return 0
    smoothing = checkpoint_smoothing(embedder.config, cfg.smooth_k, cfg.smooth_weight,
                                     cfg.smooth_rounds)
    if cfg.engine != "local" or cfg.kind in COMPRESSED_KINDS or cfg.max_index_memory:
        if smoothing.active:
            print("  gallery smoothing: not applied by sharded builds (plain embeddings "
                  "stored)")
        print_report(build_sharded(
            embedder, cfg.photos, cfg.out, cfg.checkpoint, dims=cfg.dims, kind=cfg.kind,
            batch_size=cfg.batch_size, recall_k=cfg.recall_k, progress=cfg.progress,
            engine=cfg.engine, address=cfg.address, ray_actors=cfg.ray_actors,
            ray_cpus=cfg.threads, shard_size=cfg.shard_size,
            max_index_memory=cfg.max_index_memory, nprobe=cfg.nprobe, device=cfg.device,
        ), cfg.recall_k)
        return 0
    report = build_index(
        embedder, cfg.photos, cfg.out, cfg.checkpoint, cfg.dims, cfg.kind, cfg.batch_size,
        cfg.recall_k, cfg.progress, cache, cfg.workers, smoothing,
    )
    s = report.sidecar
    print(f"index: {report.out}")
    print(f"  {s.count} photos, kind={s.kind}, dims={s.dims} of L={s.L}, backbone={s.backbone}")
    print(f"  backbone features of {report.from_cache} of {s.count} photos from the feature "
          f"cache {cache}" if cache else "  feature cache: not used")
    print(f"  gallery smoothing: {s.smoothing['k']} neighbours, weight {s.smoothing['weight']}, "
          f"{s.smoothing['rounds']} rounds" if s.smoothing else "  gallery smoothing: off")
    print(f"  checkpoint sha256 {s.checkpoint_sha256[:16]}..., built in {report.seconds:.1f}s")
    for d, r in report.recall.items():
        print(f"  recall@{cfg.recall_k} vs exact at d={d}: {r:.4f}")
    print(f"serve it: python -m service --index {report.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
