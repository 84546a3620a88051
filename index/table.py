"""The photo table of an index version: row -> (id, class, path), stored in columns that a
server maps read only and decodes one row at a time.

    photos.json         {"format", "count", "classes": [name by code], "bytes": {file: size}}
    photos.ids.bin      the ids, UTF-8, back to back
    photos.ids.npy      int64 (N+1,): row r's id is ids.bin[off[r]:off[r+1]]
    photos.paths.bin    the paths (relative to the photo root), UTF-8, back to back
    photos.paths.npy    int64 (N+1,): offsets into paths.bin, likewise
    photos.class.npy    int32 (N,): each row's class, an index into photos.json's classes
    photos.hash.npy     uint64 (N,): the ids' 64-bit BLAKE2b hashes, sorted
    photos.hashrow.npy  int64 (N,): the row of each of those hashes

Why columns: the former `meta.jsonl`, read into a list of Python objects, took 9.5 s and
383 MiB per 10^6 photos, more than a compressed index of them. Mapped, opening reads only
photos.json, and a query decodes just its k rows (measured: README, "Scale"). An id is found
by a binary search for its hash in photos.hash.npy (a few pages), then compared byte for
byte with the id of each row holding that hash.

Opening checks what costs nothing per row: photos.json, each file's size against the size it
records (a truncated or extended file is an IndexCorruptError naming it), the arrays' types
and shapes, the first and last offsets. The bytes in between are checked as rows are read: a
row that does not decode, or whose path leaves the photo root (absolute, or with `..`), is an
IndexCorruptError naming the table and the row, so photo paths stay confined row by row.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
from collections.abc import Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import numpy as np

from index.errors import IndexCorruptError
from index.gallery import Photo

TABLE_FORMAT = 1
TABLE_FILE = "photos.json"
IDS, ID_OFFSETS = "photos.ids.bin", "photos.ids.npy"
PATHS, PATH_OFFSETS = "photos.paths.bin", "photos.paths.npy"
CLASSES = "photos.class.npy"
HASHES, HASH_ROWS = "photos.hash.npy", "photos.hashrow.npy"
TABLE_FILES = (TABLE_FILE, IDS, ID_OFFSETS, PATHS, PATH_OFFSETS, CLASSES, HASHES, HASH_ROWS)
CHUNK = 65_536  # rows encoded (or copied from another table) at a time while writing


def leaves_root(path: str) -> bool:
    """Whether a table path is empty, absolute or has a `..` part (or a NUL): a photo's path
    must name a file below the photo root. String tests, a fraction of a microsecond a row."""
    return not path or path.startswith("/") or "\0" in path or ".." in path.split("/")


def check_photo_path(path: object, where: str) -> str:
    """A table path must be relative, without `..`: a photo lives below the photo root."""
    if not isinstance(path, str) or not path:
        raise IndexCorruptError(f"{where}: photo path {path!r} is not a relative path")
    if leaves_root(path):
        raise IndexCorruptError(
            f"{where}: photo path {path!r} leaves the photo root (absolute or with '..'); "
            "photos must live below the root; rebuild the index"
        )
    return path


def id_hash(photo_id: bytes) -> int:
    """The 64-bit hash an id is looked up by (BLAKE2b: the same in every process)."""
    return int.from_bytes(hashlib.blake2b(photo_id, digest_size=8).digest(), "little")


class PhotoTable(Sequence[Photo]):
    """Rows of a gallery, decoded when asked for: `table[row]` -> Photo, `row_of(id)` -> row.

    Built by `open` (the files of a version folder, memory-mapped) or `from_photos` (in
    memory, for an index that only has the `meta.jsonl` of earlier code).
    """

    def __init__(self, source: str, classes: list[str], ids: bytes | mmap.mmap,
                 id_offsets: np.ndarray, paths: bytes | mmap.mmap, path_offsets: np.ndarray,
                 codes: np.ndarray, hashes: np.ndarray, hash_rows: np.ndarray):
        self.source = source  # named by errors: the folder, or the meta.jsonl it came from
        self.classes = tuple(classes)  # class names by code
        self._ids, self._id_off = ids, id_offsets  # blob, (N+1,) int64
        self._paths, self._path_off = paths, path_offsets  # blob, (N+1,) int64
        self._codes = codes  # (N,) int32
        self._hashes, self._hash_rows = hashes, hash_rows  # (N,) uint64 sorted, (N,) int64
        self._n = len(codes)
        # Row reads index these: a memoryview gives a Python int in ~40 ns, numpy ~150 ns.
        self._id_at, self._path_at = memoryview(id_offsets), memoryview(path_offsets)
        self._code_at = memoryview(codes)

    @classmethod
    def open(cls, folder: str | Path) -> PhotoTable:
        """Map the table files of `folder` read only; IndexCorruptError names a file that is
        missing, of another size than photos.json records, or not the array it should be."""
        folder = Path(folder)
        head_path = folder / TABLE_FILE
        try:
            head = json.loads(head_path.read_text(encoding="utf-8"))
            fmt, count = head["format"], int(head["count"])
            classes, sizes = [str(c) for c in head["classes"]], dict(head["bytes"])
        except FileNotFoundError:
            raise IndexCorruptError(f"{str(folder)!r} has no {TABLE_FILE}; rebuild the "
                                    "index") from None
        except (ValueError, KeyError, TypeError) as err:
            raise IndexCorruptError(f"{str(head_path)!r} is not a photo table header ({err}); "
                                    "rebuild the index") from err
        if fmt != TABLE_FORMAT:
            raise IndexCorruptError(f"{str(head_path)!r} has format {fmt!r}; this code reads "
                                    f"{TABLE_FORMAT}")
        for name in TABLE_FILES[1:]:
            try:
                size = (folder / name).stat().st_size
            except FileNotFoundError:
                raise IndexCorruptError(f"photo table {str(folder)!r} is missing {name}; "
                                        "rebuild the index") from None
            if size != sizes.get(name):
                raise IndexCorruptError(
                    f"{str(folder / name)!r} holds {size} bytes, but {TABLE_FILE} records "
                    f"{sizes.get(name)}: the file is truncated or was changed; rebuild the index")
        id_off = _load_npy(folder / ID_OFFSETS, np.int64, (count + 1,))
        path_off = _load_npy(folder / PATH_OFFSETS, np.int64, (count + 1,))
        ids, paths = _map(folder / IDS), _map(folder / PATHS)
        for blob, off, name in ((ids, id_off, ID_OFFSETS), (paths, path_off, PATH_OFFSETS)):
            if int(off[0]) != 0 or int(off[-1]) != len(blob):
                raise IndexCorruptError(
                    f"{str(folder / name)!r} runs from {int(off[0])} to {int(off[-1])}, not "
                    f"over the {len(blob)} bytes of its .bin; rebuild the index")
        return cls(str(folder), classes, ids, id_off, paths, path_off,
                   _load_npy(folder / CLASSES, np.int32, (count,)),
                   _load_npy(folder / HASHES, np.uint64, (count,)),
                   _load_npy(folder / HASH_ROWS, np.int64, (count,)))

    @classmethod
    def from_photos(cls, photos: Iterable[Photo], source: str) -> PhotoTable:
        """A table in memory holding `photos` in order (ValueError as `write_table`)."""
        ids, paths = io.BytesIO(), io.BytesIO()
        columns = _Columns(ids, paths)
        columns.add(photos)
        table = cls(source, list(columns.classes), ids.getvalue(), paths=paths.getvalue(),
                    **columns.finish())
        _check_unique(table)
        return table

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"PhotoTable({self._n} rows of {self.source!r})"

    def __getitem__(self, row) -> Photo:
        """The photo of one row (negative rows count from the end, as in a list)."""
        if isinstance(row, slice):
            raise TypeError("a photo table is read a row at a time, not by slices")
        row = int(row)
        if row < 0:
            row += self._n
        if not 0 <= row < self._n:
            raise IndexError(f"row {row} is outside the table of {self._n} photos")
        ids, paths = self._id_at, self._path_at
        a, b, c, d = ids[row], ids[row + 1], paths[row], paths[row + 1]
        code = self._code_at[row]
        if not 0 <= a < b <= len(self._ids):
            raise self._damaged(row, f"id bytes {a}..{b} of {len(self._ids)}")
        if not 0 <= c < d <= len(self._paths):
            raise self._damaged(row, f"path bytes {c}..{d} of {len(self._paths)}")
        if not 0 <= code < len(self.classes):
            raise self._damaged(row, f"class code {code} of {len(self.classes)} classes")
        try:
            photo_id, path = self._ids[a:b].decode(), self._paths[c:d].decode()
        except UnicodeDecodeError as err:
            raise self._damaged(row, f"id or path is not UTF-8 ({err})") from err
        if leaves_root(path):
            check_photo_path(path, f"photo table {self.source!r} row {row}")
        return Photo(id=photo_id, cls=self.classes[code], path=path)

    def row_of(self, photo_id: str) -> int | None:
        """The row of the photo with this id, or None."""
        try:
            key = photo_id.encode()
        except UnicodeEncodeError:  # a lone surrogate: no stored id is one
            return None
        h = np.uint64(id_hash(key))  # same dtype as the array: searchsorted copies nothing
        i = int(np.searchsorted(self._hashes, h))
        while i < self._n and self._hashes[i] == h:
            row = int(self._hash_rows[i])
            if 0 <= row < self._n and self._id(row) == key:
                return row
            i += 1
        return None

    def _id(self, row: int) -> bytes:
        start, end = self._id_at[row], self._id_at[row + 1]
        if not 0 <= start < end <= len(self._ids):
            raise self._damaged(row, f"id bytes {start}..{end} of {len(self._ids)}")
        return self._ids[start:end]

    def _damaged(self, row: int, what: str) -> IndexCorruptError:
        return IndexCorruptError(f"photo table {self.source!r} row {row} is damaged: {what}; "
                                 "rebuild the index")


def write_table(folder: str | Path, *parts: PhotoTable | Iterable[Photo]) -> int:
    """Write the rows of `parts`, one part after the other, as the table files in `folder`
    (a version being staged: the files must not exist yet), each flushed to disk; returns
    the number of rows. The caller fsyncs the folder. Parts are read a chunk of rows at a
    time, a PhotoTable's straight from its columns, so no part need be in memory as Photo
    objects. ValueError names a path that leaves the photo root or an id given twice.
    """
    folder = Path(folder)
    with open(folder / IDS, "xb") as ids, open(folder / PATHS, "xb") as paths:
        columns = _Columns(ids, paths)
        for part in parts:
            columns.add(part)
        for f in (ids, paths):
            f.flush()
            os.fsync(f.fileno())
    arrays = columns.finish()
    _check_unique(PhotoTable(str(folder), list(columns.classes), _map(folder / IDS),
                             paths=_map(folder / PATHS), **arrays))
    for name, key in ((ID_OFFSETS, "id_offsets"), (PATH_OFFSETS, "path_offsets"),
                      (CLASSES, "codes"), (HASHES, "hashes"), (HASH_ROWS, "hash_rows")):
        with open(folder / name, "xb") as f:
            np.save(f, arrays[key])
            f.flush()
            os.fsync(f.fileno())
    count = len(arrays["codes"])
    head = {"format": TABLE_FORMAT, "count": count, "classes": list(columns.classes),
            "bytes": {name: (folder / name).stat().st_size for name in TABLE_FILES[1:]}}
    with open(folder / TABLE_FILE, "x", encoding="utf-8") as f:  # last: it marks the table
        f.write(json.dumps(head) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return count


class _Columns:
    """A table being written: the id and path bytes go to two binary files as rows come;
    their lengths, class codes and id hashes are kept (28 bytes a row) for `finish`."""

    def __init__(self, ids: BinaryIO, paths: BinaryIO):
        self.ids, self.paths = ids, paths
        self.classes: dict[str, int] = {}  # name -> code, in order of first appearance
        self.id_lens: list[np.ndarray] = []  # chunks of (n,) int64
        self.path_lens: list[np.ndarray] = []
        self.codes: list[np.ndarray] = []  # chunks of (n,) int32
        self.hashes: list[np.ndarray] = []  # chunks of (n,) uint64

    def add(self, part: PhotoTable | Iterable[Photo]) -> None:
        if isinstance(part, PhotoTable):
            self._add_table(part)
            return
        rows = iter(part)
        while chunk := list(islice(rows, CHUNK)):
            self._add_rows(chunk)

    def _add_rows(self, photos: list[Photo]) -> None:
        for p in photos:
            if not isinstance(p.id, str) or not p.id:
                raise ValueError(f"photo id {p.id!r} is not a non-empty string")
            if not isinstance(p.path, str) or leaves_root(p.path):
                raise ValueError(f"photo {p.id!r} has path {p.path!r}, which leaves the photo "
                                 "root (table paths are relative, without '..')")
        ids = [p.id.encode() for p in photos]
        paths = [p.path.encode() for p in photos]
        self._append(ids, paths, np.fromiter(
            (self.classes.setdefault(p.cls, len(self.classes)) for p in photos), np.int32,
            len(photos)))

    def _add_table(self, table: PhotoTable) -> None:
        """Copy `table` a chunk of rows at a time; its offsets and codes are checked and its
        hashes recomputed from the ids, not trusted."""
        remap = np.array([self.classes.setdefault(c, len(self.classes)) for c in table.classes],
                         np.int32)
        for start in range(0, len(table), CHUNK):
            stop = min(start + CHUNK, len(table))
            codes = np.asarray(table._codes[start:stop])
            if not (0 <= codes.min() and codes.max() < len(remap)):
                raise table._damaged(start, "class codes outside the class list")
            self._append(_split(table, table._ids, table._id_off[start : stop + 1], start),
                         _split(table, table._paths, table._path_off[start : stop + 1], start),
                         remap[codes])

    def _append(self, ids: list[bytes], paths: list[bytes], codes: np.ndarray) -> None:
        self.ids.write(b"".join(ids))
        self.paths.write(b"".join(paths))
        self.id_lens.append(np.fromiter(map(len, ids), np.int64, len(ids)))
        self.path_lens.append(np.fromiter(map(len, paths), np.int64, len(paths)))
        self.codes.append(codes)
        self.hashes.append(np.fromiter(map(id_hash, ids), np.uint64, len(ids)))

    def finish(self) -> dict[str, np.ndarray]:
        """The arrays of the table: offsets, codes, and the hashes sorted with their rows."""
        hashes = np.concatenate([np.zeros(0, np.uint64), *self.hashes])
        order = np.argsort(hashes, kind="stable")  # (N,) rows by hash
        return {"id_offsets": _offsets(self.id_lens), "path_offsets": _offsets(self.path_lens),
                "codes": np.concatenate([np.zeros(0, np.int32), *self.codes]),
                "hashes": hashes[order], "hash_rows": order.astype(np.int64)}


def _offsets(lengths: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.zeros(1, np.int64), *lengths]).cumsum()  # (N+1,)


def _split(table: PhotoTable, blob, offsets: np.ndarray, first: int) -> list[bytes]:
    """The values of rows first.. of a table column, from their (n+1,) offsets."""
    offs = np.asarray(offsets)
    if offs[0] < 0 or offs[-1] > len(blob) or np.any(offs[1:] < offs[:-1]):
        raise table._damaged(first, f"offsets outside 0..{len(blob)} or decreasing in rows "
                                    f"{first}..{first + len(offs) - 2}")
    data = blob[int(offs[0]) : int(offs[-1])]
    rel = (offs - offs[0]).tolist()
    return [data[a:b] for a, b in zip(rel[:-1], rel[1:], strict=True)]


def _check_unique(table: PhotoTable) -> None:
    """ValueError naming an id on two rows (equal neighbours among the sorted hashes are
    compared byte for byte: two ids may share a hash)."""
    same = np.flatnonzero(table._hashes[1:] == table._hashes[:-1])  # (M,)
    for i in same.tolist():
        a, b = (int(r) for r in table._hash_rows[i : i + 2])
        if table._id(a) == table._id(b):
            raise ValueError(f"photo id {table[a].id!r} is on two rows ({min(a, b)} and "
                             f"{max(a, b)}); ids must be unique")


def _map(path: Path) -> bytes | mmap.mmap:
    """The bytes of `path`, mapped read only (b"" for an empty file, which cannot be)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:  # removed since it was checked: a writer replaced the version
        raise IndexCorruptError(f"{str(path)!r} is missing; rebuild the index") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _load_npy(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise IndexCorruptError(f"cannot read {str(path)!r} ({err}); rebuild the index") from err
    if array.dtype != np.dtype(dtype) or array.shape != shape:
        raise IndexCorruptError(f"{str(path)!r} holds {array.dtype} {array.shape}, expected "
                                f"{np.dtype(dtype)} {shape}; rebuild the index")
    return array.view(np.ndarray)  # still the mapped pages, without np.memmap's slow indexing
