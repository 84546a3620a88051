"""An index on disk: `index.faiss`, the `index.json` sidecar and the `meta.jsonl` table.

Writes are atomic: everything is written into a temporary sibling folder, the sidecar last,
then the folder is renamed into place. Loading checks that the three files agree, so a
half-written or hand-edited index is refused, and that the checkpoint is the one the
index was built from.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import faiss
import numpy as np

from index.gallery import Photo
from index.search import pad_queries

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
INDEX_FILE = "index.faiss"
SIDECAR_FILE = "index.json"
META_FILE = "meta.jsonl"
METRIC = "inner_product"


class IndexStoreError(Exception):
    """Base of the errors raised when an index on disk cannot be used."""


class IndexNotFoundError(IndexStoreError):
    """No index at the given folder."""


class IndexCorruptError(IndexStoreError):
    """The index files are incomplete or disagree with each other."""


class IndexMismatchError(IndexStoreError):
    """The index was built from a different checkpoint."""


@dataclass(frozen=True)
class Sidecar:
    """What an index file is: enough to check it and to serve it without flags."""

    format: int
    checkpoint_sha256: str
    checkpoint: str  # path of the checkpoint at build time (a hint; the hash is the identity)
    backbone: str
    L: int  # embedding size of the checkpoint
    dims: int  # stored prefix length, 1 <= dims <= L
    metric: str
    count: int
    kind: str
    created: str
    photos_root: str  # meta paths are relative to this folder (or absolute)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Sidecar:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise IndexCorruptError(f"sidecar {source!r} is not valid JSON: {err}") from err
        names = {f.name for f in fields(cls)}
        missing = names - raw.keys()
        if missing:
            raise IndexCorruptError(f"sidecar {source!r} lacks fields {sorted(missing)}")
        if raw["format"] != FORMAT_VERSION:
            raise IndexCorruptError(
                f"sidecar {source!r} has format {raw['format']!r}; this code reads {FORMAT_VERSION}"
            )
        return cls(**{k: raw[k] for k in names})


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class GalleryIndex:
    """A loaded index: FAISS search over d-prefixes plus the photo table."""

    def __init__(self, folder: Path, index: faiss.Index, sidecar: Sidecar, photos: list[Photo]):
        self.folder = folder
        self.index = index
        self.sidecar = sidecar
        self.photos = photos
        self.rows = {p.id: i for i, p in enumerate(photos)}

    @property
    def dims(self) -> int:
        return self.sidecar.dims

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
        scores, rows = self.index.search(pad_queries(queries, self.dims), min(k, len(self)))
        return scores, rows

    def photo_path(self, photo: Photo, photos_root: Path | None = None) -> Path:
        """Absolute path of a photo; `photos_root` overrides the root recorded at build."""
        root = Path(self.sidecar.photos_root) if photos_root is None else photos_root
        return root / photo.path


def check_replaceable(out: Path) -> None:
    """Only an empty folder or a folder holding exactly an index may be replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{str(out)!r} exists and is not a folder; not replacing it")
    names = {p.name for p in out.iterdir()}
    ours = {INDEX_FILE, SIDECAR_FILE, META_FILE}
    if names and (SIDECAR_FILE not in names or not names <= ours):
        raise FileExistsError(
            f"{str(out)!r} exists and is not an index folder (it holds "
            f"{sorted(names - ours)[:5] or sorted(names)}); choose another --out"
        )


def write_index(
    out_dir: str | Path, index: faiss.Index, sidecar: Sidecar, photos: list[Photo]
) -> Path:
    """Atomically write (or replace) the index folder `out_dir`; returns its path."""
    if index.ntotal != sidecar.count or len(photos) != sidecar.count:
        raise ValueError(
            f"index holds {index.ntotal} vectors and the table {len(photos)} photos; "
            f"the sidecar says {sidecar.count}"
        )
    out = Path(out_dir).absolute()
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        faiss.write_index(index, str(tmp / INDEX_FILE))
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            for p in photos:
                f.write(json.dumps({"id": p.id, "class": p.cls, "path": p.path}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # The sidecar is written last: a folder without it is never a complete index.
        with open(tmp / SIDECAR_FILE, "w", encoding="utf-8") as f:
            f.write(sidecar.to_json())
            f.flush()
            os.fsync(f.fileno())
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s index of %d photos (%d dims) to %s", sidecar.kind, sidecar.count,
             sidecar.dims, out)
    return out


def read_sidecar(folder: str | Path) -> Sidecar:
    """Read and check `index.json` of an index folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise IndexNotFoundError(f"no index folder at {str(folder)!r}")
    path = folder / SIDECAR_FILE
    if not path.is_file():
        raise IndexCorruptError(
            f"{str(folder)!r} has no {SIDECAR_FILE}: it is not a complete index "
            "(an interrupted build leaves no sidecar); rebuild it"
        )
    return Sidecar.from_json(path.read_text(encoding="utf-8"), str(path))


def read_meta(path: Path) -> list[Photo]:
    photos = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                photos.append(Photo(id=row["id"], cls=row["class"], path=row["path"]))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                msg = f"{str(path)!r} line {line_no} is malformed: {err}"
                raise IndexCorruptError(msg) from err
    return photos


def load_index(
    folder: str | Path, checkpoint_sha256: str | None = None, mmap: bool = True
) -> GalleryIndex:
    """Open an index folder, check it is complete and (if given) built from that checkpoint.

    `mmap=True` maps the vectors read only (serving); `False` loads a writable copy (append).
    """
    folder = Path(folder)
    sidecar = read_sidecar(folder)
    if checkpoint_sha256 is not None and checkpoint_sha256 != sidecar.checkpoint_sha256:
        raise IndexMismatchError(
            f"index {str(folder)!r} was built from checkpoint sha256 "
            f"{sidecar.checkpoint_sha256[:16]}... ({sidecar.checkpoint}), but the checkpoint "
            f"given has sha256 {checkpoint_sha256[:16]}...; rebuild the index with "
            f"python -m index.build --checkpoint CKPT --photos DIR --out {folder}"
        )
    for name in (INDEX_FILE, META_FILE):
        if not (folder / name).is_file():
            raise IndexCorruptError(f"index {str(folder)!r} is missing {name}")
    flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    try:
        index = faiss.read_index(str(folder / INDEX_FILE), flags)
    except RuntimeError as err:
        raise IndexCorruptError(f"cannot read {str(folder / INDEX_FILE)!r}: {err}") from err
    photos = read_meta(folder / META_FILE)
    if not (index.ntotal == len(photos) == sidecar.count):
        raise IndexCorruptError(
            f"index {str(folder)!r} disagrees with itself: {INDEX_FILE} holds {index.ntotal} "
            f"vectors, {META_FILE} {len(photos)} rows, {SIDECAR_FILE} says {sidecar.count}"
        )
    if index.d != sidecar.dims or not 1 <= sidecar.dims <= sidecar.L:
        raise IndexCorruptError(
            f"index {str(folder)!r} has {index.d} dims; sidecar says dims={sidecar.dims}, "
            f"L={sidecar.L}"
        )
    return GalleryIndex(folder, index, sidecar, photos)

