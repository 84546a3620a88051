"""Build a retrieval index from a model bundle and a photo folder.

    python -m index.build --model runs/cdk/model --photos PHOTOS --out runs/index

PHOTOS is any folder of photos: flat, in class subfolders (the first level is the class),
or the photo side of a Sketchy-layout folder (`index.gallery`); files that are not images
are skipped and counted, photos that fail to decode are left out and listed. Embeds every
photo with the bundle's photo encoder (ONNX Runtime on the CPU, in the precision the bundle
chose when it was written: `--encoder`, `--precision`), smooths the gallery as the bundle
says (`--smooth-*`), keeps the first `--dims` coordinates (default all: the learned modes,
then the raw coordinates) and writes an index of `--kind` (`index.kinds`; "auto": exact up to
100,000 photos, else the most exact kind that fits `--max-index-memory`), with its recall
against exact search printed when it is approximate. To add photos to an index later:
`python -m index.add`.

`--engine ray`, a code kind (ivfsq8, scanprefix, ivfsq48, ivfpq, opq) or `--max-index-memory`
build through resumable embedding shards on disk (`index.sharded`); otherwise the embeddings
are kept in memory. Both store the same vectors: the gallery is embedded slice by slice
(`--shard-size` photos) either way. Photos whose frozen-backbone features training cached
(`--feature-cache`, by default the cache the bundle's training wrote; `none` turns reuse
off) only go through the photo head; the others are decoded by `--workers` DataLoader
processes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from index.assemble import BuildReport, assemble, check_dims
from index.blocks import array_blocks
from index.embed import (
    ENCODERS,
    PRECISIONS,
    VIEWS,
    embed_slice,
    feature_cache_dir,
    photo_encoder,
)
from index.errors import IndexStoreError
from index.gallery import scan_gallery
from index.kinds import KINDS, get, parse_bytes
from index.neighbours import model_smoothing
from index.sharded import ENGINES, build_sharded
from index.shards import DEFAULT_SHARD_SIZE
from index.store import IndexWriter, check_replaceable, load_index
from index.threads import set_threads
from training import cli
from training.allocator import tune_allocator
from training.cdk.model.bundle import Bundle
from training.cdk.model.smoothing import Smoothing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildConfig:
    model: str = ""  # the model bundle training wrote (runs/cdk/model)
    photos: str = ""  # any folder of photos (see above)
    out: str = ""  # index folder to write (replaced atomically)
    dims: int | None = None  # stored coordinates; None: the embeddings' whole width
    kind: str = "auto"  # an index.kinds name, or auto
    batch_size: int = 32
    recall_k: int = 10
    device: str | None = None  # torch device; None: CUDA when present, else CPU
    threads: int = 2  # CPU threads of the encoder, torch and FAISS
    feature_cache: str | None = None  # training's feature cache; None: the bundle's; "none"
    workers: int = 1  # DataLoader processes decoding photos; 0: the main one
    encoder: str = "auto"  # photo encoder: auto (ONNX Runtime on CPU) | onnx | torch
    precision: str = "auto"  # ONNX graph: auto (the bundle's choice) | fp32 | int8
    # 1: each photo in one view (one backbone pass); 2: averaged with its mirror image, as
    # the model was trained (twice the backbone work); index.add follows the index's
    photo_views: int = 1
    progress: bool = True
    # Gallery smoothing (training.cdk.model.smoothing) of the stored photo vectors; None: the
    # bundle's values (training's --smooth-*); --smooth-k 0 stores the plain embeddings.
    smooth_k: int | None = None
    smooth_weight: float | None = None
    smooth_rounds: int | None = None
    # Sharded builds (index.sharded): taken when --engine ray, a code --kind or
    # --max-index-memory is given.
    engine: str = "local"  # local | ray: where photos are embedded into OUT/shards
    address: str | None = None  # Ray cluster address; None: a local Ray on --threads CPUs
    ray_actors: int = 0  # Ray actors holding the model; 0: one per GPU, else one per CPU
    shard_size: int = DEFAULT_SHARD_SIZE  # photos per embedding shard (and in-memory slice)
    max_index_memory: str | None = None  # e.g. 3G: auto picks the most exact kind that fits
    nprobe: int = 0  # cells probed per query by the IVF kinds; 0: 64
    # leave the index at --out as it is when it was built with this model from the same
    # photos (the same folder and files); else build it
    reuse: bool = False


def build_index(
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
    threads: int = 2,
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_index_memory: str | None = None,
    nprobe: int = 0,
    precision: str = "auto",
    device: str | None = None,
    photo_views: int = 1,
) -> BuildReport:
    """Embed the gallery `photos` with `model` (a Bundle) in memory and write an index
    folder at `out` (the new version replaces the current one atomically; another writer of
    `out` is an IndexLockedError). `feature_cache`: training's feature cache folder to reuse
    photo features from (None: none); `workers`: DataLoader processes decoding the other
    photos (0: this one); `smoothing`: of the stored vectors (None: the model's); `encoder`,
    `precision`, `device`, `photo_views`: the photo encoder (`index.embed.photo_encoder`)."""
    start = time.perf_counter()
    dims = check_dims(model, dims)
    if smoothing is None:
        smoothing = model_smoothing(model)
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size} must be >= 1")
    out = Path(out).absolute()
    check_replaceable(out)  # fail before minutes of embedding, not after
    scan = scan_gallery(photos)
    log.info("gallery %s: %s", scan.root, scan.summary())
    gallery = scan.photos
    with IndexWriter(out) as writer:  # held while embedding: a second writer fails at once
        enc = photo_encoder(model, threads, encoder, precision, device, photo_views)
        t0, blocks, kept, failed, cached = time.perf_counter(), [], [], [], 0
        for s in range(0, len(gallery), shard_size):  # a sharded build's slices: same bits
            part = embed_slice(model, enc, scan.root, gallery[s : s + shard_size],
                               feature_cache, batch_size, workers, progress, photo_views)
            blocks += array_blocks(part.vectors, offset=len(kept))
            kept += part.photos
            failed += part.failed
            cached += part.from_cache
        embed_s = time.perf_counter() - t0
        if not kept:
            raise ValueError(f"none of the {len(gallery)} photos of {str(photos)!r} decoded; "
                             f"the first failed with: {failed[0][1]}")
        built = assemble(writer, model, scan.root, [kept], blocks, dims, kind,
                         parse_bytes(max_index_memory) if max_index_memory else None, nprobe,
                         smoothing, recall_k, progress=progress, photo_views=photo_views)
    return BuildReport(built.out, built.sidecar, built.recall, time.perf_counter() - start,
                       cached, len(gallery), 0, built.index_bytes, embed_s,
                       f"{enc.name} {enc.precision}", scan.skipped,
                       [(p.path, why) for p, why in failed])


def is_current(out: str | Path, model, photos: str | Path, photo_views: int = 1) -> bool:
    """Whether the index at `out` holds exactly the photos of `photos` (same root, same
    paths) embedded by `model` (same bundle sha256) in `photo_views`."""
    try:
        current = load_index(out, model_sha256=model.sha256)
    except (IndexStoreError, OSError):
        return False
    scan = scan_gallery(photos)
    return (current.sidecar.photo_views == photo_views
            and Path(current.sidecar.photos_root) == scan.root
            and sorted(p.path for p in current.photos) == sorted(p.path for p in scan.photos))


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    """One dashed flag per BuildConfig field (training.cli); --model, --photos and --out are
    required."""
    parser = cli.build_parser(
        BuildConfig,
        prog="python -m index.build",
        description=__doc__,
        choices={"kind": ["auto", *KINDS], "engine": list(ENGINES), "encoder": list(ENCODERS),
                 "precision": list(PRECISIONS), "photo_views": list(VIEWS)},
        required=("model", "photos", "out"),
    )
    return cli.parse(parser, BuildConfig, argv)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    tune_allocator()
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    model = Bundle.open(cfg.model)
    if cfg.reuse and is_current(cfg.out, model, cfg.photos, cfg.photo_views):
        print(f"index {cfg.out} was built with this model from these photos: kept")
        print(f"serve it: python -m service --index {cfg.out}")
        return 0
    cache = feature_cache_dir(cfg.feature_cache, model)
    smoothing = model_smoothing(model, cfg.smooth_k, cfg.smooth_weight, cfg.smooth_rounds)
    common = dict(dims=cfg.dims, kind=cfg.kind, batch_size=cfg.batch_size,
                  recall_k=cfg.recall_k, progress=cfg.progress, feature_cache=cache,
                  workers=cfg.workers, smoothing=smoothing, encoder=cfg.encoder,
                  precision=cfg.precision, threads=cfg.threads, shard_size=cfg.shard_size,
                  max_index_memory=cfg.max_index_memory, nprobe=cfg.nprobe, device=cfg.device,
                  photo_views=cfg.photo_views)
    if cfg.engine != "local" or cfg.max_index_memory or (
            cfg.kind != "auto" and get(cfg.kind).streams):
        report = build_sharded(model, cfg.photos, cfg.out, **common, engine=cfg.engine,
                               address=cfg.address, ray_actors=cfg.ray_actors)
    else:
        report = build_index(model, cfg.photos, cfg.out, **common)
    print_report(report, cfg.recall_k, cache)
    return 0


def print_report(report: BuildReport, recall_k: int, cache: str | None) -> None:
    s = report.sidecar
    print(f"index: {report.out}")
    print(f"  {s.count} photos, kind={s.kind}, dims={s.dims} of width {s.width} ({s.modes} "
          f"modes), backbone={s.backbone}")
    for reason, paths in sorted((report.skipped or {}).items()):
        print(f"  skipped {len(paths)} {reason}: " + ", ".join(paths[:5])
              + (", ..." if len(paths) > 5 else ""))
    for path, why in (report.failed or [])[:20]:
        print(f"  left out {path}: {why}")
    if report.failed and len(report.failed) > 20:
        print(f"  ... and {len(report.failed) - 20} more photos that failed to decode")
    if s.params:
        print(f"  params {s.params}")
    if report.shards:
        print(f"  {report.shards} shards, {report.embedded} photos embedded by this run")
    if report.embedded:
        by = (f", {report.embedded - report.from_cache} by the {report.encoder} photo encoder"
              if report.encoder else "")
        print(f"  embedding: {report.embedded} photos in {report.embed_seconds:.1f}s "
              f"({report.embedded / max(report.embed_seconds, 1e-9):.1f} photos/s{by}), "
              + ("each averaged with its mirror image" if s.photo_views == 2 else "one view each"))
    print(f"  backbone features of {report.from_cache} of {report.embedded} embedded photos "
          f"from the feature cache {cache}" if cache else "  feature cache: not used")
    print(f"  gallery smoothing: {s.smoothing['k']} neighbours, weight {s.smoothing['weight']}, "
          f"{s.smoothing['rounds']} rounds" if s.smoothing else "  gallery smoothing: off")
    print(f"  index file {report.index_bytes / 2**20:.1f} MiB; model {s.model} (sha256 "
          f"{s.model_sha256[:16]}...), built in {report.seconds:.1f}s")
    for d, r in report.recall.items():
        print(f"  recall@{recall_k} vs exact at d={d}: {r:.4f}")
    print(f"serve it: python -m service --index {report.out}")


if __name__ == "__main__":
    raise SystemExit(main())
