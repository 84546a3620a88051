"""Add photos to an existing index without rebuilding it.

    python -m index.add --index runs/index --photos NEW_PHOTOS [--checkpoint CKPT]

Photos already in the index (same id, same file) are skipped; an id that names a different
file is an error. The checkpoint defaults to the one recorded in the sidecar and must have
the same hash. New photos must live below the index's photo root (the sidecar's
`photos_root`): table paths are relative to it, and the service serves nothing outside it.
The new version replaces the current one atomically, under the index's writer lock.
New photos are embedded as by `index.build` (`--feature-cache`, `--workers`, `--encoder`,
`--precision`) and,
when the index was built with gallery smoothing, smoothed against the stored photos by the
same rule (the stored ones keep their vectors until a rebuild). The index's kind adds them
(the code kinds encode them with their trained quantizers).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from index.embed import (
    ENCODERS,
    PRECISIONS,
    cached_features,
    embed_photos,
    feature_cache_dir,
    photo_encoder,
)
from index.gallery import scan_gallery
from index.neighbours import smooth_added
from index.store import IndexWriter, Sidecar, load_index, now_utc, read_sidecar
from index.threads import set_threads
from training import cli
from training.allocator import tune_allocator
from training.cdk.model.embedder import Embedder
from training.cdk.model.smoothing import Smoothing
from training.folders import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppendReport:
    out: Path
    sidecar: Sidecar
    added: int
    skipped: int
    from_cache: int = 0  # added photos whose backbone features came from the feature cache


def append_photos(
    embedder: Embedder,
    index_dir: str | Path,
    photos: str | Path,
    batch_size: int = 32,
    progress: bool = True,
    feature_cache: str | Path | None = None,
    workers: int = 0,
    encoder: str = "auto",
    threads: int = 2,
    precision: str = "auto",
) -> AppendReport:
    """Embed the photos of `photos` not yet in the index and add them to it (`feature_cache`,
    `workers`, `encoder`, `threads` and `precision` as in `index.build.build_index`).

    Holds the index's writer lock from reading the current version to writing the new one,
    so two appends never both start from the same version (one would drop the other's
    photos). DataError names a photo outside the index's photo root.
    """
    with IndexWriter(index_dir, create=False) as writer:
        current = load_index(index_dir, checkpoint_sha256=embedder.checkpoint_sha256,
                             mmap=False)
        old_root = Path(current.sidecar.photos_root).resolve()
        root, gallery = scan_gallery(photos)
        new = []
        skipped = 0
        for p in gallery:
            path = (root / p.path).resolve()
            row = current.row_of(p.id)
            if row is None:
                if not path.is_relative_to(old_root):
                    raise DataError(
                        f"photo {str(root / p.path)!r} is outside the index's photo root "
                        f"{str(old_root)!r}; put new photos below it (the index stores paths "
                        "relative to it and serves nothing else)"
                    )
                new.append(dataclasses.replace(p, path=path.relative_to(old_root).as_posix()))
                continue
            known = current.photo_path(current.photos[row]).resolve()
            if known != path:
                raise ValueError(
                    f"photo id {p.id!r} is already in the index as {str(known)!r}; "
                    f"cannot add {str(root / p.path)!r} under the same id"
                )
            skipped += 1
        cached = cached_features(embedder, old_root, new, feature_cache if new else None)
        if new:
            kind, index = current.kind, current.index
            vectors = embed_photos(embedder, old_root, new,
                                   photo_encoder(embedder, index_dir, threads, encoder,
                                                 precision),
                                   batch_size, progress, cached, workers)[:, : current.dims]
            if current.sidecar.smoothing:  # as the build smoothed the stored photos
                vectors = smooth_added(kind.reconstruct(index, 0, index.ntotal), vectors,
                                       Smoothing(**current.sidecar.smoothing))
            kind.add(index, vectors)
        sidecar = dataclasses.replace(
            current.sidecar, count=current.index.ntotal, created=now_utc()
        )
        out = writer.commit(current.index, sidecar, current.photos, new)  # table copied
    log.info("appended %d photos (%d already indexed) to %s", len(new), skipped, out)
    return AppendReport(out, sidecar, len(new), skipped, len(cached[0]))


def print_append(report: AppendReport) -> None:
    s = report.sidecar
    print(f"index: {report.out}")
    print(f"  added {report.added} photos ({report.from_cache} from the feature cache), "
          f"skipped {report.skipped} already indexed")
    print(f"  now {s.count} photos, kind={s.kind}, dims={s.dims} of width {s.width}")


@dataclass(frozen=True)
class AddConfig:
    index: str = ""  # existing index folder
    photos: str = ""  # folder of <class>/<photo> to add
    checkpoint: str | None = None  # None: the checkpoint recorded in the sidecar
    batch_size: int = 32
    device: str | None = None
    threads: int = 2
    feature_cache: str | None = None  # training's feature cache; None: the checkpoint's; "none"
    workers: int = 1  # DataLoader processes decoding photos; 0: the main one
    encoder: str = "auto"  # photo encoder: auto (ONNX Runtime on CPU) | onnx | torch
    precision: str = "auto"  # ONNX graph: auto | fp32 | int8 (as index.build)
    progress: bool = True


def parse_args(argv: list[str] | None = None) -> AddConfig:
    """One dashed flag per AddConfig field (training.cli); --index and --photos are
    required."""
    parser = cli.build_parser(AddConfig, prog="python -m index.add",
                              description=__doc__,
                              choices={"encoder": list(ENCODERS), "precision": list(PRECISIONS)},
                              required=("index", "photos"))
    return cli.parse(parser, AddConfig, argv)


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    tune_allocator()
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    checkpoint = cfg.checkpoint or read_sidecar(cfg.index).checkpoint
    embedder = Embedder.from_checkpoint(checkpoint, device=cfg.device)
    print_append(append_photos(embedder, cfg.index, cfg.photos, cfg.batch_size, cfg.progress,
                               feature_cache_dir(cfg.feature_cache, embedder), cfg.workers,
                               cfg.encoder, cfg.threads, cfg.precision))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
