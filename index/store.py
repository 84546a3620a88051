"""An index on disk: a folder of versions and a pointer file naming the current one.

    OUT/CURRENT              the name of the current version (one line)
    OUT/v-<UTC time>-<hex>/  index.faiss, the index.json sidecar and the photo table
                             (photos.json and its columns, `index.table`)
    OUT/.lock                held (flock) by the one process writing OUT
    OUT/shards/              embedding shards of sharded builds (index.shards), reused on reruns

A writer stages a version in OUT/.tmp-<hex>/, fsyncs its files and the folder, renames it to
OUT/v-.../, then replaces CURRENT (temp file, fsync, rename, fsync OUT). Readers follow
CURRENT, so a writer killed at any moment leaves the old index (before the rename of CURRENT)
or the new one (after). The version CURRENT named before a write is kept until the next write,
so a reader that just followed the old pointer still finds it; older versions and the
temporaries of killed writers are removed by later writers.

There is one format (FORMAT_VERSION). A sidecar of the format before it (3, which did not
record the photos' views) is read as that code stored its photos: averaged with their
mirror image (`photo_views` 2). Folders written by earlier code (the three files directly in
OUT, a `meta.jsonl` photo table, a sidecar of another format or without the fields of this
one) are refused with an error naming the folder and the fix, a rebuild, which may write
over them.

Each version's sidecar lists the sha256 and size of every other file of the version, and
loading checks them before FAISS or the table reader opens a file, so a file changed or
planted after the build is refused; a version folder or file that is a link is refused too.
Loading then checks that the index, the sidecar and the table agree, so a half-written or
hand-edited index is refused, and that the model bundle is the one the index was built with
(its sha256).
Every photo path is relative and stays below the photo root, checked row by row as rows are
read (`index.table`). The index's kind (`index.kinds`) answers its searches.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

import faiss
import numpy as np

from index import kinds
from index.errors import (
    IndexCorruptError,
    IndexLockedError,
    IndexMismatchError,
    IndexNotFoundError,
)
from index.gallery import Photo
from index.table import TABLE_FILE, PhotoTable, write_table
from training.files import fsync_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 4
MIRRORED_FORMAT = 3  # read as FORMAT_VERSION with photo_views 2: every photo mirror-averaged
INDEX_FILE = "index.faiss"
SIDECAR_FILE = "index.json"
META_FILE = "meta.jsonl"  # the photo table of earlier code: refused
METRIC = "inner_product"
POINTER_FILE = "CURRENT"
LOCK_FILE = ".lock"
SHARDS_DIR = "shards"  # index.shards keeps the embedding shards of sharded builds here
VERSION_NAME = re.compile(r"^v-\d{8}T\d{6}Z-[0-9a-f]{12}$")
STAGE_NAME = re.compile(r"^\.tmp-[0-9a-f]{32}$")
POINTER_TEMP_NAME = re.compile(r"^\.CURRENT\.tmp-[0-9a-f]{32}$")
# The layout of earlier code, directly in OUT: refused by readers, replaced by a rebuild.
FLAT_FILES = (INDEX_FILE, META_FILE, SIDECAR_FILE)
# How a server opens index.faiss: IO_FLAG_MMAP_IFC maps the vectors and codes of every kind
# (flat, IVF, SQ, PQ) from the file, read only (FAISS 1.15's IO_FLAG_MMAP still copied a flat
# index's vectors into memory). Such an index cannot be added to (append loads a copy).
SERVE_IO_FLAGS = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


@dataclass(frozen=True)
class Sidecar:
    """What an index file is: enough to check it and to serve it without flags."""

    format: int
    model_sha256: str  # the model bundle's identity (training.cdk.model.bundle)
    model: str  # the bundle's folder at build time (where the service finds it by default)
    backbone: str
    width: int  # the embeddings' width: the learned modes, then the raw coordinates
    modes: int  # the learned modes: coordinates 1..modes (d-prefixes up to it use them alone)
    dims: int  # stored prefix length, 1 <= dims <= width
    metric: str
    count: int
    kind: str  # an index.kinds name
    created: str
    photos_root: str  # photo table paths are relative to this folder
    params: dict  # the kind's parameters (cells, probes, code sizes); {} for flat
    recall: dict  # recall@k against exact search measured at build ({}: an exact kind)
    smoothing: dict  # the gallery smoothing of the stored vectors ({k, weight, rounds}; {}: none)
    # the hubness correction ({k, weight}; {}: none): the stored vectors then have one more
    # coordinate after the dims, minus each photo's penalty (index.hubness)
    hubness: dict
    files: dict  # {file name: {"sha256", "bytes"}} of every other file of the version
    # 1: each photo embedded in one view; 2: averaged with its mirror image (index.embed)
    photo_views: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str, folder: str | Path) -> Sidecar:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise IndexCorruptError(f"sidecar {source!r} is not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise IndexCorruptError(f"sidecar {source!r} is not a JSON object")
        fix = f"rebuild it: {rebuild_command(folder)}"
        if raw.get("format") == MIRRORED_FORMAT and "photo_views" not in raw:
            raw = {**raw, "format": FORMAT_VERSION, "photo_views": 2}
        if raw.get("format") != FORMAT_VERSION:
            raise IndexCorruptError(
                f"index {str(folder)!r} was written by earlier code (sidecar format "
                f"{raw.get('format')!r}; this code reads format {FORMAT_VERSION}); {fix}")
        names = {f.name for f in fields(cls)}
        missing, extra = names - raw.keys(), raw.keys() - names
        if missing or extra:
            raise IndexCorruptError(
                f"sidecar {source!r} lacks fields {sorted(missing)} or has unknown ones "
                f"{sorted(extra)}; {fix}")
        return cls(**raw)


def rebuild_command(folder: str | Path) -> str:
    return f"python -m index.build --model MODEL --photos DIR --out {folder}"


def new_sidecar(model, dims: int, count: int, kind: str, photos_root: Path,
                params: dict | None = None, recall: dict | None = None,
                smoothing: dict | None = None, hubness: dict | None = None,
                photo_views: int = 1) -> Sidecar:
    """The sidecar of a freshly built index: the model bundle's identity (`model`, a
    training.cdk.model.bundle.Bundle), the stored dims and count, the kind, the photos'
    views, now. Its file list is filled in when the version is written
    (IndexWriter.commit)."""
    return Sidecar(
        format=FORMAT_VERSION,
        model_sha256=model.sha256,
        model=str(Path(model.path).absolute()) if model.path else "",
        backbone=model.backbone,
        width=int(model.width),
        modes=int(model.modes),
        dims=dims,
        metric=METRIC,
        count=count,
        kind=kind,
        created=now_utc(),
        photos_root=str(photos_root),
        params=params or {},
        recall=recall or {},
        smoothing=smoothing or {},
        hubness=hubness or {},
        files={},
        photo_views=int(photo_views),
    )


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class GalleryIndex:
    """A loaded index: FAISS search over d-prefixes, answered by its kind (`index.kinds`),
    plus the photo table (`photos[row]` -> Photo, decoded when asked for)."""

    def __init__(self, folder: Path, index: faiss.Index, sidecar: Sidecar, photos: PhotoTable):
        self.folder = folder
        self.index = index
        self.sidecar = sidecar
        self.photos = photos
        self.kind = kinds.get(sidecar.kind)

    def row_of(self, photo_id: str) -> int | None:
        """The row of the photo with this id, or None."""
        return self.photos.row_of(photo_id)

    @property
    def dims(self) -> int:
        """The embedding's coordinates stored: what `dims` queries may ask for."""
        return self.sidecar.dims

    @property
    def corrected(self) -> bool:
        """Whether the stored vectors carry the hubness correction's coordinate after the
        dims (a full-width query then has a 1 appended: `query_width`)."""
        return bool(self.sidecar.hubness)

    def query_width(self, dims: int) -> int:
        """The width of a `dims` query as the index is searched: dims, plus the correction's
        coordinate for a full-width query of a corrected index."""
        return dims + (1 if self.corrected and dims == self.dims else 0)

    def __len__(self) -> int:
        return len(self.photos)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k photos by inner product over the first d dims; `queries` is (N, d).

        Returns (scores (N, k'), rows (N, k')) with k' = min(k, count), scores descending.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2:
            raise ValueError(f"queries must be (N, d); got shape {queries.shape}")
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        if not 1 <= queries.shape[1] <= self.index.d:
            raise ValueError(f"query has {queries.shape[1]} dims; the index stores "
                             f"{self.index.d}")
        return self.kind.search(self.index, queries, min(k, len(self)))

    def vectors(self, rows: np.ndarray, dims: int | None = None) -> np.ndarray:
        """The stored vectors of `rows` (M,), as the index scores them (decoded for code
        kinds): (M, D), D >= `dims` (None: all stored dims)."""
        return self.kind.vectors(self.index, np.asarray(rows, dtype=np.int64), dims)

    def pool(self, queries: np.ndarray, count: int
             ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """Candidates to re-score for queries near `queries` (N, d), at least `count` where
        the gallery holds them: rows, their vectors and the queries in the kind's scoring
        basis (Kind.pool; query expansion)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        return self.kind.pool(self.index, queries, min(count, len(self)))

    def photo_path(self, photo: Photo, photos_root: Path | None = None) -> Path:
        """Absolute path of a photo; `photos_root` overrides the root recorded at build."""
        root = Path(self.sidecar.photos_root) if photos_root is None else photos_root
        return root / photo.path


def _is_ours(name: str) -> bool:
    return (name in (*FLAT_FILES, POINTER_FILE, LOCK_FILE, SHARDS_DIR)
            or bool(VERSION_NAME.match(name)) or bool(STAGE_NAME.match(name))
            or bool(POINTER_TEMP_NAME.match(name)))


def check_replaceable(out: Path) -> None:
    """Only an empty folder or an index folder (either layout) may be written."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{str(out)!r} exists and is not a folder; not replacing it")
    names = {p.name for p in out.iterdir()}
    marked = names & {SIDECAR_FILE, POINTER_FILE, LOCK_FILE}
    if names and (not marked or not all(map(_is_ours, names))):
        others = sorted(n for n in names if not _is_ours(n))
        raise FileExistsError(
            f"{str(out)!r} exists and is not an index folder (it holds "
            f"{others[:5] or sorted(names)[:5]}); choose another --out"
        )


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digests(version: Path) -> dict[str, dict]:
    """{name: {"sha256", "bytes"}} of the files of a staged version (the sidecar aside)."""
    return {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
            for p in sorted(version.iterdir()) if p.name != SIDECAR_FILE}


def check_files(folder: Path, version: Path, sidecar: Sidecar) -> None:
    """Every file of `version` is the one its sidecar lists (size, then sha256), is no link,
    and none is missing or extra: IndexCorruptError names the first that is not."""
    fix = f"rebuild it: {rebuild_command(folder)}"
    if version.is_symlink():
        raise IndexCorruptError(f"index version {str(version)!r} is a link; {fix}")
    present = {p.name for p in version.iterdir() if p.name != SIDECAR_FILE}
    listed = set(sidecar.files)
    if present != listed:
        raise IndexCorruptError(
            f"index version {str(version)!r} holds files its sidecar does not list "
            f"{sorted(present - listed)[:5]} or lacks listed ones {sorted(listed - present)[:5]}"
            f"; {fix}")
    for name, entry in sorted(sidecar.files.items()):
        path = version / name
        if path.is_symlink() or not path.is_file():
            raise IndexCorruptError(f"{str(path)!r} is a link or not a regular file; {fix}")
        if path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
            raise IndexCorruptError(f"{str(path)!r} is not the file the sidecar lists "
                                    f"(changed since the index was built); {fix}")


def _write_text(path: Path, text: str) -> None:
    """Create `path` (it must not exist) holding `text`, flushed to disk; mode 0666 & ~umask."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read_pointer(folder: Path) -> str | None:
    """The version CURRENT names; None when there is no CURRENT (earlier layout or no index)."""
    try:
        name = (folder / POINTER_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not VERSION_NAME.match(name):
        raise IndexCorruptError(
            f"{str(folder / POINTER_FILE)!r} holds {name[:80]!r}, not a version name; rebuild "
            f"the index with python -m index.build --out {folder}"
        )
    return name


def current_version(folder: str | Path) -> Path:
    """The version folder `folder/<name in CURRENT>` holding the current index of `folder`.

    IndexNotFoundError when there is no folder, IndexCorruptError when it holds no complete
    index (or one in the layout of earlier code).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise IndexNotFoundError(f"no index folder at {str(folder)!r}")
    name = _read_pointer(folder)
    if name is None:
        if (folder / SIDECAR_FILE).is_file():
            raise IndexCorruptError(
                f"{str(folder)!r} holds an index in the layout of earlier code (its files "
                f"directly in the folder, no {POINTER_FILE}); rebuild it: "
                f"{rebuild_command(folder)}")
        raise IndexCorruptError(
            f"{str(folder)!r} has no {POINTER_FILE}: it is not a complete index (an "
            f"interrupted first build leaves none); rebuild it: {rebuild_command(folder)}"
        )
    version = folder / name
    if version.is_symlink():
        raise IndexCorruptError(f"{str(folder / POINTER_FILE)!r} names {name!r}, which is a link; "
                                f"an index version is a folder the index writer made: "
                                f"{rebuild_command(folder)}")
    if not version.is_dir():
        raise IndexCorruptError(f"{str(folder / POINTER_FILE)!r} names {name!r}, which is "
                                f"missing; rebuild it: {rebuild_command(folder)}")
    return version


class IndexWriter:
    """The one writer of an index folder: holds an exclusive lock on OUT/.lock while open.

        with IndexWriter(out) as writer:
            ...  # read the current index, embed photos
            writer.commit(index, sidecar, photos)  # or several parts: (table, new_photos)

    IndexLockedError when another process holds the lock (it is released by the kernel
    when that process dies, however it dies). Entering removes the temporaries of killed
    writers; `commit` swaps in the new version, then removes versions older than the one it
    replaced. `create=False` requires OUT to exist (appending).
    """

    def __init__(self, out: str | Path, create: bool = True):
        self.out = Path(out).absolute()
        self.create = create
        self._fd: int | None = None

    def __enter__(self) -> IndexWriter:
        out = self.out
        check_replaceable(out)
        if not out.is_dir():
            if not self.create:
                raise IndexNotFoundError(f"no index folder at {str(out)!r}")
            out.mkdir(parents=True)  # 0777 & ~umask: a service running as another user reads it
            fsync_dir(out.parent)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise IndexLockedError(
                f"index {str(out)!r} is being written by another process (pid {holder} holds "
                f"{str(out / LOCK_FILE)!r}); wait for it to finish, then run again"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._remove(n for n in os.listdir(out)
                     if STAGE_NAME.match(n) or POINTER_TEMP_NAME.match(n))
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _remove(self, names) -> None:
        for name in names:
            path = self.out / name
            log.info("removing %s", path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def commit(self, index: faiss.Index, sidecar: Sidecar,
               *photos: PhotoTable | Iterable[Photo]) -> Path:
        """Write a new version and make it current; returns OUT. The photo table is the rows
        of the `photos` parts one after the other (`index.table.write_table`)."""
        if self._fd is None:
            raise RuntimeError("IndexWriter.commit called outside its `with` block")
        if index.ntotal != sidecar.count:
            raise ValueError(f"index holds {index.ntotal} vectors; the sidecar says "
                             f"{sidecar.count}")
        out = self.out
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        name = f"v-{stamp}-{uuid.uuid4().hex[:12]}"
        stage = out / f".tmp-{uuid.uuid4().hex}"
        os.mkdir(stage)  # 0777 & ~umask, unlike mkdtemp's 0700
        try:
            faiss.write_index(index, str(stage / INDEX_FILE))
            _fsync_file(stage / INDEX_FILE)
            rows = write_table(stage, *photos)
            if rows != sidecar.count:
                raise ValueError(f"the photo table has {rows} rows; the sidecar says "
                                 f"{sidecar.count}")
            sidecar = replace(sidecar, files=_digests(stage))
            _write_text(stage / SIDECAR_FILE, sidecar.to_json())
            fsync_dir(stage)
            os.rename(stage, out / name)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        fsync_dir(out)
        previous = _read_pointer(out)
        pointer = out / f".CURRENT.tmp-{uuid.uuid4().hex}"
        try:
            _write_text(pointer, name + "\n")
            os.rename(pointer, out / POINTER_FILE)
        except BaseException:
            pointer.unlink(missing_ok=True)
            raise
        fsync_dir(out)  # the new pointer is durable: from here on the old version may go
        keep = {name, previous}
        self._remove(n for n in os.listdir(out) if VERSION_NAME.match(n) and n not in keep)
        self._remove(n for n in FLAT_FILES if (out / n).exists())  # rebuilt over the old layout
        log.info("wrote %s index of %d photos (%d dims) to %s (version %s)", sidecar.kind,
                 sidecar.count, sidecar.dims, out, name)
        return out


def write_index(
    out_dir: str | Path, index: faiss.Index, sidecar: Sidecar, photos: Iterable[Photo]
) -> Path:
    """Write (or replace) the index folder `out_dir` under its lock; returns its path."""
    with IndexWriter(out_dir) as writer:
        return writer.commit(index, sidecar, photos)


def read_sidecar(folder: str | Path) -> Sidecar:
    """Read and check the sidecar of the current index of `folder`."""
    return _read_sidecar_at(Path(folder), current_version(folder))


def _read_sidecar_at(folder: Path, version: Path) -> Sidecar:
    path = version / SIDECAR_FILE
    if path.is_symlink():
        raise IndexCorruptError(f"{str(path)!r} is a link; rebuild it: {rebuild_command(folder)}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IndexCorruptError(
            f"{str(version)!r} has no {SIDECAR_FILE}: it is not a complete index; rebuild it: "
            f"{rebuild_command(folder)}") from None
    return Sidecar.from_json(text, str(path), folder)


def load_index(
    folder: str | Path, model_sha256: str | None = None, mmap: bool = True
) -> GalleryIndex:
    """Open the current index of a folder, check its files against its sidecar, that it is
    complete and (if given) built with that model bundle.

    `mmap=True` maps the vectors read only (serving); `False` loads a writable copy (append).
    Lock-free: a writer may swap versions meanwhile; a version removed while it was being
    read is retried from the new pointer.
    """
    folder = Path(folder)
    version = current_version(folder)
    for _ in range(2):
        try:
            return _load_version(folder, version, model_sha256, mmap)
        except (IndexCorruptError, FileNotFoundError):
            newer = current_version(folder)
            if newer == version:
                raise
            version = newer  # a writer removed the version being read: follow the new pointer
    return _load_version(folder, version, model_sha256, mmap)


def _load_version(folder: Path, version: Path, model_sha256: str | None, mmap: bool
                  ) -> GalleryIndex:
    sidecar = _read_sidecar_at(folder, version)
    if model_sha256 is not None and model_sha256 != sidecar.model_sha256:
        raise IndexMismatchError(
            f"index {str(folder)!r} was built with the model bundle of sha256 "
            f"{sidecar.model_sha256[:16]}... ({sidecar.model}), but the model given has sha256 "
            f"{model_sha256[:16]}...; rebuild the index with python -m index.build --model "
            f"MODEL --photos DIR --out {folder}"
        )
    check_files(folder, version, sidecar)
    flags = SERVE_IO_FLAGS if mmap else 0
    try:
        index = faiss.read_index(str(version / INDEX_FILE), flags)
    except RuntimeError as err:
        raise IndexCorruptError(f"cannot read {str(version / INDEX_FILE)!r}: {err}") from err
    photos = _read_table(folder, version)
    if not (index.ntotal == len(photos) == sidecar.count):
        raise IndexCorruptError(
            f"index {str(folder)!r} disagrees with itself: {INDEX_FILE} holds {index.ntotal} "
            f"vectors, {TABLE_FILE} {len(photos)} rows, {SIDECAR_FILE} says {sidecar.count}"
        )
    extra = 1 if sidecar.hubness else 0  # the correction's coordinate
    if index.d != sidecar.dims + extra or not 1 <= sidecar.dims <= sidecar.width:
        raise IndexCorruptError(
            f"index {str(folder)!r} has {index.d} dims; sidecar says dims={sidecar.dims}"
            f"{' + 1 (hubness)' if extra else ''}, width={sidecar.width}"
        )
    if sidecar.kind not in kinds.KINDS:
        raise IndexCorruptError(f"index {str(folder)!r} is of kind {sidecar.kind!r}, which this "
                                f"code does not know; rebuild it: {rebuild_command(folder)}")
    return GalleryIndex(folder, index, sidecar, photos)


def _read_table(folder: Path, version: Path) -> PhotoTable:
    """The photo table of a version, mapped; the meta.jsonl of earlier code is refused."""
    if not (version / TABLE_FILE).is_file() and (version / META_FILE).is_file():
        raise IndexCorruptError(
            f"index {str(folder)!r} has the photo table of earlier code ({META_FILE}); rebuild "
            f"it: {rebuild_command(folder)}")
    return PhotoTable.open(version)  # names what is missing
