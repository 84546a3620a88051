"""Build a retrieval index from a checkpoint and a photo folder.

    python -m index.build --checkpoint runs/cdk/checkpoint.pt \
        --photos ../shared/data/sketchy-mini --out runs/index

Embeds every photo with the checkpoint's photo side (ONNX Runtime on the CPU, `--encoder`;
in int8 where it holds the service's parity rule on the photo side and is faster, `--precision`),
smooths the gallery as the checkpoint says (`--smooth-*`), keeps the first `--dims`
coordinates (default all: the learned modes, then the raw coordinates) and writes an index of
`--kind` (`index.kinds`; "auto": exact up to 100,000 photos, else the most exact kind that
fits `--max-index-memory`), with its recall against exact search printed when it is
approximate. `--append` adds new photos to the index at `--out` (as `index.add`).

`--engine ray`, a code kind (ivfsq8, scanprefix, ivfsq48, ivfpq, opq) or `--max-index-memory` build
through resumable embedding shards on disk (`index.sharded`); otherwise the embeddings are
kept in memory. Both store the same vectors: the gallery is embedded slice by slice
(`--shard-size` photos) either way. Photos whose frozen-backbone features training cached
(`--feature-cache`, by default the checkpoint's `cache_dir`; `none` turns reuse off) only go
through the photo head; the others are decoded by `--workers` DataLoader processes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from index.add import append_photos, print_append
from index.assemble import BuildReport, assemble, check_dims
from index.blocks import array_blocks
from index.embed import (
    ENCODERS,
    PRECISIONS,
    embed_slice,
    feature_cache_dir,
    photo_encoder,
)
from index.gallery import scan_gallery
from index.kinds import KINDS, get, parse_bytes
from index.neighbours import checkpoint_smoothing
from index.sharded import ENGINES, build_sharded
from index.shards import DEFAULT_SHARD_SIZE
from index.store import IndexWriter, check_replaceable
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
    dims: int | None = None  # stored coordinates; None: the embeddings' whole width
    kind: str = "auto"  # an index.kinds name, or auto
    batch_size: int = 32
    recall_k: int = 10
    device: str | None = None  # torch device; None: CUDA when present, else CPU
    threads: int = 2  # CPU threads of the encoder, torch and FAISS
    append: bool = False  # add new photos to the index at --out instead of rebuilding
    feature_cache: str | None = None  # training's feature cache; None: the checkpoint's; "none"
    workers: int = 1  # DataLoader processes decoding photos; 0: the main one
    encoder: str = "auto"  # photo encoder: auto (ONNX Runtime on CPU) | onnx | torch
    # ONNX graph: auto (int8 where it holds parity and is faster on this CPU) | fp32 | int8
    precision: str = "auto"
    progress: bool = True
    # Gallery smoothing (training.cdk.model.smoothing) of the stored photo vectors; None: the
    # checkpoint's values (training's --smooth-*); --smooth-k 0 stores the plain embeddings.
    smooth_k: int | None = None
    smooth_weight: float | None = None
    smooth_rounds: int | None = None
    # Sharded builds (index.sharded): taken when --engine ray, a code --kind or
    # --max-index-memory is given.
    engine: str = "local"  # local | ray: where photos are embedded into OUT/shards
    address: str | None = None  # Ray cluster address; None: a local Ray on --threads CPUs
    ray_actors: int = 0  # Ray actors holding the embedder; 0: one per GPU, else one per CPU
    shard_size: int = DEFAULT_SHARD_SIZE  # photos per embedding shard (and in-memory slice)
    max_index_memory: str | None = None  # e.g. 3G: auto picks the most exact kind that fits
    nprobe: int = 0  # cells probed per query by the IVF kinds; 0: 64


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
    encoder: str = "auto",
    threads: int = 2,
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_index_memory: str | None = None,
    nprobe: int = 0,
    precision: str = "auto",
) -> BuildReport:
    """Embed the gallery `photos` in memory and write an index folder at `out` (the new
    version replaces the current one atomically; another writer of `out` is an
    IndexLockedError). `feature_cache`: training's feature cache folder to reuse photo
    features from (None: none); `workers`: DataLoader processes decoding the other photos
    (0: this one); `smoothing`: of the stored vectors (None: the checkpoint's); `encoder`,
    `precision`: the photo encoder (`index.embed.photo_encoder`)."""
    start = time.perf_counter()
    dims = check_dims(embedder, dims)
    if smoothing is None:
        smoothing = checkpoint_smoothing(embedder.config)
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size} must be >= 1")
    out = Path(out).absolute()
    check_replaceable(out)  # fail before minutes of embedding, not after
    root, gallery = scan_gallery(photos)
    with IndexWriter(out) as writer:  # held while embedding: a second writer fails at once
        enc = photo_encoder(embedder, out, threads, encoder, precision)
        t0, blocks, cached = time.perf_counter(), [], 0
        for s in range(0, len(gallery), shard_size):  # a sharded build's slices: same bits
            vectors, hits = embed_slice(embedder, enc, root, gallery[s : s + shard_size],
                                        feature_cache, batch_size, workers, progress)
            blocks += array_blocks(vectors, offset=s)
            cached += hits
        embed_s = time.perf_counter() - t0 - getattr(enc, "make_seconds", 0.0)
        built = assemble(writer, embedder, checkpoint, root, [gallery], blocks, dims, kind,
                         parse_bytes(max_index_memory) if max_index_memory else None, nprobe,
                         smoothing, recall_k, progress=progress)
    return BuildReport(built.out, built.sidecar, built.recall, time.perf_counter() - start,
                       cached, len(gallery), 0, built.index_bytes, embed_s,
                       f"{enc.name} {enc.precision}" if enc.precision else "")


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    """One dashed flag per BuildConfig field (training.cli); --checkpoint, --photos and
    --out are required."""
    parser = cli.build_parser(
        BuildConfig,
        prog="python -m index.build",
        description=__doc__,
        choices={"kind": ["auto", *KINDS], "engine": list(ENGINES), "encoder": list(ENCODERS),
                 "precision": list(PRECISIONS)},
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
                                   cache, cfg.workers, cfg.encoder, cfg.threads,
                                   cfg.precision))
        return 0
    smoothing = checkpoint_smoothing(embedder.config, cfg.smooth_k, cfg.smooth_weight,
                                     cfg.smooth_rounds)
    common = dict(dims=cfg.dims, kind=cfg.kind, batch_size=cfg.batch_size,
                  recall_k=cfg.recall_k, progress=cfg.progress, feature_cache=cache,
                  workers=cfg.workers, smoothing=smoothing, encoder=cfg.encoder,
                  precision=cfg.precision,
                  threads=cfg.threads, shard_size=cfg.shard_size,
                  max_index_memory=cfg.max_index_memory, nprobe=cfg.nprobe)
    if cfg.engine != "local" or cfg.max_index_memory or (
            cfg.kind != "auto" and get(cfg.kind).streams):
        report = build_sharded(embedder, cfg.photos, cfg.out, cfg.checkpoint, **common,
                               engine=cfg.engine, address=cfg.address,
                               ray_actors=cfg.ray_actors, device=cfg.device)
    else:
        report = build_index(embedder, cfg.photos, cfg.out, cfg.checkpoint, **common)
    print_report(report, cfg.recall_k, cache)
    return 0


def print_report(report: BuildReport, recall_k: int, cache: str | None) -> None:
    s = report.sidecar
    print(f"index: {report.out}")
    print(f"  {s.count} photos, kind={s.kind}, dims={s.dims} of width {s.width} ({s.modes} "
          f"modes), backbone={s.backbone}")
    if s.params:
        print(f"  params {s.params}")
    if report.shards:
        print(f"  {report.shards} shards, {report.embedded} photos embedded by this run")
    if report.embedded:
        by = (f", {report.embedded - report.from_cache} by the {report.encoder} photo encoder"
              if report.encoder else "")
        print(f"  embedding: {report.embedded} photos in {report.embed_seconds:.1f}s "
              f"({report.embedded / max(report.embed_seconds, 1e-9):.1f} photos/s{by})")
    print(f"  backbone features of {report.from_cache} of {report.embedded} embedded photos "
          f"from the feature cache {cache}" if cache else "  feature cache: not used")
    print(f"  gallery smoothing: {s.smoothing['k']} neighbours, weight {s.smoothing['weight']}, "
          f"{s.smoothing['rounds']} rounds" if s.smoothing else "  gallery smoothing: off")
    print(f"  index file {report.index_bytes / 2**20:.1f} MiB; checkpoint sha256 "
          f"{s.checkpoint_sha256[:16]}..., built in {report.seconds:.1f}s")
    for d, r in report.recall.items():
        print(f"  recall@{recall_k} vs exact at d={d}: {r:.4f}")
    print(f"serve it: python -m service --index {report.out}")


if __name__ == "__main__":
    raise SystemExit(main())
