"""Add photos to an existing index without rebuilding it.

    python -m index.add --index runs/index --photos NEW_PHOTOS [--model MODEL]

NEW_PHOTOS is any folder of photos below the index's photo root (the sidecar's
`photos_root`): table paths are relative to it, and the service serves nothing outside it; a
photo's class is the first folder below that root, as in a build. Photos already in the
index (the same file) are skipped. The model defaults to the bundle recorded in the sidecar
and must be the one the index was built with (its sha256). The new version replaces the
current one atomically, under the index's writer lock. New photos are embedded as by
`index.build` (`--feature-cache`, `--workers`, `--encoder`, `--precision`), in the views
its photos were embedded in (the sidecar's `photo_views`) and, when the
index was built with gallery smoothing, smoothed against the stored photos by the same rule
(the stored ones keep their vectors until a rebuild), and given their hubness penalty when
the index stores one. The index's kind adds them (the code
kinds encode them with their trained quantizers).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from index.embed import (
    ENCODERS,
    PRECISIONS,
    cached_features,
    embed_photos,
    feature_cache_dir,
    photo_encoder,
)
from index.gallery import Photo, path_hash, photo_id, scan_gallery
from index.hubness import corrected
from index.neighbours import smooth_added
from index.store import GalleryIndex, IndexWriter, Sidecar, load_index, now_utc, read_sidecar
from index.threads import set_threads
from training import cli
from training.allocator import tune_allocator
from training.cdk.model.bundle import Bundle
from training.cdk.model.hubness import Hubness
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
    left_out: dict | None = None  # entries the scan skipped, by reason
    failed: list | None = None  # (path, reason) of photos that did not decode


def _place(current: GalleryIndex, rel: str, taken: set[str]) -> tuple[str, bool]:
    """(the id of the photo at root path `rel`, whether the index already holds that file):
    its `photo_id`, or that with its path's hash where another photo holds it."""
    base = photo_id(rel)
    for pid in (base, f"{base}-{path_hash(rel)}"):
        row = current.row_of(pid)
        if row is None and pid not in taken:
            return pid, False
        if row is not None and current.photos[row].path == rel:
            return pid, True
    raise DataError(f"photo {rel!r} cannot be given an id: {base!r} and its hashed form are "
                    "taken by other photos; rename the file")


def append_photos(
    model,
    index_dir: str | Path,
    photos: str | Path,
    batch_size: int = 32,
    progress: bool = True,
    feature_cache: str | Path | None = None,
    workers: int = 0,
    encoder: str = "auto",
    threads: int = 2,
    precision: str = "auto",
    device: str | None = None,
) -> AppendReport:
    """Embed the photos of `photos` not yet in the index and add them to it (`feature_cache`,
    `workers`, `encoder`, `threads`, `precision` and `device` as in
    `index.build.build_index`).

    Holds the index's writer lock from reading the current version to writing the new one,
    so two appends never both start from the same version (one would drop the other's
    photos). DataError names a photo outside the index's photo root.
    """
    with IndexWriter(index_dir, create=False) as writer:
        current = load_index(index_dir, model_sha256=model.sha256, mmap=False)
        old_root = Path(current.sidecar.photos_root).resolve()
        scan = scan_gallery(photos)
        new: list[Photo] = []
        skipped = 0
        taken: set[str] = set()
        for p in scan.photos:
            path = (scan.root / p.path).resolve()
            if not path.is_relative_to(old_root):
                raise DataError(
                    f"photo {str(scan.root / p.path)!r} is outside the index's photo root "
                    f"{str(old_root)!r}; put new photos below it (the index stores paths "
                    "relative to it and serves nothing else)")
            rel = path.relative_to(old_root).as_posix()
            pid, known = _place(current, rel, taken)
            if known:
                skipped += 1
                continue
            parts = PurePosixPath(rel).parts
            taken.add(pid)
            new.append(Photo(id=pid, cls=parts[0] if len(parts) > 1 else "", path=rel))
        views = current.sidecar.photo_views  # as the index's photos were embedded
        cached = cached_features(model, old_root, new, feature_cache if new else None, views)
        failed = []
        if new:
            kind, index = current.kind, current.index
            part = embed_photos(model, old_root, new,
                                photo_encoder(model, threads, encoder, precision, device,
                                              views),
                                batch_size, progress, cached, workers)
            new, failed = part.photos, part.failed
            vectors = part.vectors[:, : current.dims]
            if current.sidecar.smoothing:  # as the build smoothed the stored photos
                stored = kind.reconstruct(index, 0, index.ntotal)[:, : current.dims]
                vectors = smooth_added(stored, vectors, Smoothing(**current.sidecar.smoothing))
            if current.corrected:  # and corrected them
                vectors = corrected(vectors, model.hubness_sample(),
                                    Hubness(**current.sidecar.hubness))
            kind.add(index, vectors)
        sidecar = dataclasses.replace(
            current.sidecar, count=current.index.ntotal, created=now_utc()
        )
        out = writer.commit(current.index, sidecar, current.photos, new)  # table copied
    log.info("appended %d photos (%d already indexed) to %s", len(new), skipped, out)
    return AppendReport(out, sidecar, len(new), skipped, len(cached[0]), scan.skipped,
                        [(p.path, why) for p, why in failed])


def print_append(report: AppendReport) -> None:
    s = report.sidecar
    print(f"index: {report.out}")
    print(f"  added {report.added} photos ({report.from_cache} from the feature cache), "
          f"skipped {report.skipped} already indexed")
    for reason, paths in sorted((report.left_out or {}).items()):
        print(f"  skipped {len(paths)} {reason}: " + ", ".join(paths[:5])
              + (", ..." if len(paths) > 5 else ""))
    for path, why in (report.failed or [])[:20]:
        print(f"  left out {path}: {why}")
    print(f"  now {s.count} photos, kind={s.kind}, dims={s.dims} of width {s.width}")


@dataclass(frozen=True)
class AddConfig:
    index: str = ""  # existing index folder
    photos: str = ""  # a folder of photos below the index's photo root
    model: str | None = None  # None: the model bundle recorded in the sidecar
    batch_size: int = 32
    device: str | None = None
    threads: int = 2
    feature_cache: str | None = None  # training's feature cache; None: the bundle's; "none"
    workers: int = 1  # DataLoader processes decoding photos; 0: the main one
    encoder: str = "auto"  # photo encoder: auto (ONNX Runtime on CPU) | onnx | torch
    precision: str = "auto"  # ONNX graph: auto (the bundle's choice) | fp32 | int8
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
    model = Bundle.open(cfg.model or read_sidecar(cfg.index).model)
    print_append(append_photos(model, cfg.index, cfg.photos, cfg.batch_size, cfg.progress,
                               feature_cache_dir(cfg.feature_cache, model), cfg.workers,
                               cfg.encoder, cfg.threads, cfg.precision, cfg.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
