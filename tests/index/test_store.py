"""Index build/load: FAISS against brute force, atomic writes, sidecar checks, append, and
the index folders of earlier code refused with the fix."""

import json
import os
import shutil
import stat

import numpy as np
import pytest
from PIL import Image

import index.build as build_mod
import index.store as store_mod
from index import add as add_mod
from index.assemble import blocks_recall
from index.blocks import array_blocks
from index.build import build_index
from index.embed import embed_photos
from index.gallery import Photo, path_hash, scan_gallery
from index.kinds import get
from index.store import (
    INDEX_FILE,
    META_FILE,
    POINTER_FILE,
    SIDECAR_FILE,
    IndexCorruptError,
    IndexLockedError,
    IndexMismatchError,
    IndexNotFoundError,
    IndexWriter,
    Sidecar,
    current_version,
    load_index,
)
from index.table import PATHS, TABLE_FILE, TABLE_FILES, PhotoTable
from tests.fakes import FakeModel, make_gallery
from tests.index.earlier import to_meta_jsonl
from training.folders import DataError


@pytest.fixture
def gallery(tmp_path):
    return make_gallery(tmp_path / "photos", classes=3, per_class=5)


@pytest.fixture
def embedder():
    return FakeModel(L=8)


def sketch_queries(embedder, n=6, seed=1):
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
    return embedder.embed(images, "sketch")  # (n, L)


@pytest.mark.parametrize("stored", [8, 5])
def test_flat_search_equals_brute_force_for_every_d(tmp_path, gallery, embedder, stored):
    build_index(embedder, gallery, tmp_path / "ix", dims=stored, progress=False)
    ix = load_index(tmp_path / "ix", model_sha256=embedder.sha256)
    scan = scan_gallery(gallery)
    root, photos = scan.root, scan.photos
    photo_emb = embedder.embed([Image.open(root / p.path) for p in photos], "photo")  # (15, L)
    queries = sketch_queries(embedder)
    assert ix.dims == stored and len(ix) == 15
    for d in sorted({1, 2, 3, stored - 1, stored}):
        brute = queries[:, :d] @ photo_emb[:, :d].T  # (6, 15)
        order = np.argsort(-brute, axis=1, kind="stable")[:, :7]
        scores, rows = ix.search(queries[:, :d], k=7)
        np.testing.assert_array_equal(rows, order)
        np.testing.assert_allclose(scores, np.take_along_axis(brute, order, 1), rtol=1e-5,
                                   atol=1e-6)
        assert np.all(np.diff(scores, axis=1) <= 0)


def test_k_larger_than_gallery_returns_whole_gallery(tmp_path, gallery, embedder):
    build_index(embedder, gallery, tmp_path / "ix", progress=False)
    scores, rows = load_index(tmp_path / "ix").search(sketch_queries(embedder, 2), k=100)
    assert rows.shape == (2, 15) and sorted(rows[0]) == list(range(15))


def test_query_with_more_dims_than_stored_is_refused(tmp_path, gallery, embedder):
    build_index(embedder, gallery, tmp_path / "ix", dims=4, progress=False)
    with pytest.raises(ValueError, match="query has 5 dims; the index stores 4"):
        load_index(tmp_path / "ix").search(np.zeros((1, 5), np.float32), k=3)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_kinds_recall_against_exact(kind, record_property):
    rng = np.random.default_rng(0)
    # Clustered data, like embeddings of photo classes.
    centers = rng.normal(size=(20, 16)).astype(np.float32)
    vectors = (centers[rng.integers(0, 20, 3000)] + 0.3 * rng.normal(size=(3000, 16))).astype(
        np.float32
    )
    index = get(kind).build_vectors(vectors, get(kind).plan(len(vectors), 16))
    recalls = blocks_recall(get(kind), index, array_blocks(vectors), 10, [4, 16], n_queries=300)
    record_property(f"{kind}_recall_at_10", recalls)
    print(f"{kind} recall@10 vs exact: {recalls}")
    assert recalls[16] >= 0.9, recalls
    # Whatever it returns, its scores are the exact inner products of the d-prefix.
    q = vectors[:5, :4]
    padded = np.zeros((5, 16), np.float32)
    padded[:, :4] = q
    scores, ids = index.search(padded, 10)
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", q, vectors[ids][:, :, :4]),
                               rtol=1e-4, atol=1e-5)


def test_build_prints_recall_for_approximate_kind(tmp_path, gallery, embedder):
    report = build_index(embedder, gallery, tmp_path / "ix", kind="hnsw",
                         progress=False)
    assert report.sidecar.kind == "hnsw"
    assert set(report.recall) == {8}  # d = 16, 64 and the stored dims, those there are
    assert all(0.0 <= r <= 1.0 for r in report.recall.values())
    assert report.recall[8] == 1.0  # 15 photos: the graph is complete enough to be exact


def test_sidecar_describes_the_index(tmp_path, gallery, embedder):
    build_index(embedder, gallery, tmp_path / "ix", dims=6, progress=False)
    version = current_version(tmp_path / "ix")
    raw = json.loads((version / SIDECAR_FILE).read_text())
    assert raw["model_sha256"] == embedder.sha256
    assert (raw["width"], raw["modes"], raw["dims"], raw["count"], raw["metric"], raw["kind"]) == (
        8, 8, 6, 15, "inner_product", "flat")
    assert "L" not in raw and raw["format"] == 4 and raw["params"] == raw["recall"] == {}
    assert raw["backbone"] == "fake-thumbnail" and raw["created"]
    assert PhotoTable.open(version)[0] == Photo("c0_0_000", "class0", "class0/c0_0_000.jpg")
    assert not (version / META_FILE).exists()  # the table is the columns alone


def test_failed_write_leaves_no_index_and_keeps_the_old_one(tmp_path, gallery, embedder,
                                                            monkeypatch):
    out = tmp_path / "ix"

    def disk_full(self):
        raise OSError("disk full")

    monkeypatch.setattr(Sidecar, "to_json", disk_full)
    with pytest.raises(OSError, match="disk full"):
        build_index(embedder, gallery, out, progress=False)
    with pytest.raises(IndexCorruptError, match="not a complete index"):
        load_index(out)
    assert [p.name for p in out.iterdir()] == [".lock"]  # no temp folder left behind
    monkeypatch.undo()

    first = build_index(embedder, gallery, out, dims=8, progress=False)
    monkeypatch.setattr(Sidecar, "to_json", disk_full)
    with pytest.raises(OSError):
        build_index(embedder, gallery, out, dims=3, progress=False)
    monkeypatch.undo()
    kept = load_index(out)
    assert kept.sidecar == first.sidecar and kept.dims == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ix", "photos"]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "CURRENT", current_version(out).name]


def test_a_table_of_another_length_than_the_index_is_not_committed(tmp_path, gallery, embedder):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, progress=False)
    ix = load_index(out, mmap=False)
    with IndexWriter(out) as writer, pytest.raises(ValueError, match="the photo table has 14 "
                                                                     "rows; the sidecar says 15"):
        writer.commit(ix.index, ix.sidecar, list(ix.photos)[:14])
    assert sorted(p.name for p in out.iterdir()) == [".lock", "CURRENT", current_version(out).name]
    assert len(load_index(out).photos) == 15


def test_half_written_or_inconsistent_index_is_refused(tmp_path, gallery, embedder):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, progress=False)
    version = current_version(out)
    paths = version / PATHS
    paths.write_bytes(paths.read_bytes()[:-10])
    with pytest.raises(IndexCorruptError, match=rf"'{paths}' is not the file the sidecar lists"):
        load_index(out)
    shutil.rmtree(version)
    build_index(embedder, gallery, out, progress=False)
    version = current_version(out)
    (version / TABLE_FILE).unlink()
    with pytest.raises(IndexCorruptError, match=r"lacks listed ones \['photos.json'\]"):
        load_index(out)
    build_index(embedder, gallery, out, progress=False)
    version = current_version(out)
    (version / SIDECAR_FILE).unlink()
    with pytest.raises(IndexCorruptError, match="not a complete index"):
        load_index(out)
    with pytest.raises(IndexNotFoundError, match="nowhere"):
        load_index(tmp_path / "nowhere")


def test_loading_with_another_checkpoint_names_both_hashes(tmp_path, gallery, embedder):
    build_index(embedder, gallery, tmp_path / "ix", progress=False)
    other = FakeModel(L=8, seed=1)
    with pytest.raises(IndexMismatchError) as err:
        load_index(tmp_path / "ix", model_sha256=other.sha256)
    msg = str(err.value)
    assert embedder.sha256[:16] in msg and other.sha256[:16] in msg
    assert "python -m index.build" in msg


def test_append_adds_new_photos_and_equals_a_rebuild(tmp_path, embedder):
    photos = make_gallery(tmp_path / "photos", classes=3, per_class=5, seed=0)
    out = tmp_path / "ix"
    build_index(embedder, photos, out, progress=False)
    scan = scan_gallery(photos)
    _, first = scan.root, scan.photos
    make_gallery(photos, classes=2, per_class=3, seed=1)  # new photos in the same gallery
    report = add_mod.append_photos(embedder, out, photos, progress=False)
    assert (report.added, report.skipped, report.sidecar.count) == (6, 15, 21)
    again = add_mod.append_photos(embedder, out, photos, progress=False)
    assert (again.added, again.skipped, again.sidecar.count) == (0, 21, 21)

    ix = load_index(out)
    scan = scan_gallery(photos)
    root, every = scan.root, scan.photos
    added = [p for p in every if p not in first]
    expected = np.concatenate([embed_photos(embedder, root, first, progress=False).vectors,
                               embed_photos(embedder, root, added, progress=False).vectors])
    np.testing.assert_allclose(ix.index.reconstruct_n(0, 21), expected, rtol=1e-6)
    assert list(ix.photos) == first + added  # paths relative to the root, as a build writes
    scores, rows = ix.search(expected[15:], k=1)
    assert np.all(rows[:, 0] >= 15)  # appended photos are found


def test_append_refuses_another_model_and_gives_a_clashing_stem_its_own_id(tmp_path, embedder):
    a = make_gallery(tmp_path / "a", classes=1, per_class=3, seed=0)
    out = tmp_path / "ix"
    build_index(embedder, a, out, progress=False)
    with pytest.raises(IndexMismatchError):
        add_mod.append_photos(FakeModel(L=8, seed=5), out, a, progress=False)
    clash = a / "other"
    clash.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(clash / "c0_0_000.jpg")  # the stem of a photo indexed
    report = add_mod.append_photos(embedder, out, clash, progress=False)
    ix = load_index(out)
    new = ix.photos[ix.row_of(f"c0_0_000-{path_hash('other/c0_0_000.jpg')}")]
    assert report.added == 1 and (new.cls, new.path) == ("other", "other/c0_0_000.jpg")
    assert ix.photos[ix.row_of("c0_0_000")].path == "class0/c0_0_000.jpg"  # kept its id
    assert add_mod.append_photos(embedder, out, a, progress=False).added == 0  # both known


def test_cli_build_and_add(tmp_path, gallery, embedder, monkeypatch, capsys):
    # both commands open the model through the one Bundle class
    monkeypatch.setattr(build_mod.Bundle, "open", lambda path: embedder)
    out = tmp_path / "ix"
    assert build_mod.main(["--model", "m", "--photos", str(gallery), "--out", str(out),
                           "--dims", "4", "--kind", "ivf", "--no-progress", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "15 photos, kind=ivf, dims=4 of width 8 (8 modes)" in text
    assert "recall@10 vs exact at d=4" in text and f"python -m service --index {out}" in text
    make_gallery(gallery, classes=1, per_class=2, seed=3)
    assert add_mod.main(["--index", str(out), "--photos", str(gallery), "--model", "m",
                         "--no-progress"]) == 0
    assert "added 2 photos" in capsys.readouterr().out
    assert load_index(out).sidecar.count == 17
    with pytest.raises(SystemExit):
        build_mod.main(["--model", "x", "--photos", "y", "--out", "z", "--bogus", "1"])


def test_build_rejects_dims_beyond_L(tmp_path, gallery, embedder):
    with pytest.raises(ValueError, match="--dims 9 is outside"):
        build_index(embedder, gallery, tmp_path / "ix", dims=9, progress=False)


def test_refuses_to_replace_a_folder_that_is_not_an_index(tmp_path, gallery, embedder):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match=r"not an index folder \(it holds \['thesis"):
        build_index(embedder, gallery, precious, progress=False)
    assert (precious / "thesis.tex").read_text() == "years of work"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match="is not a folder"):
        build_index(embedder, gallery, tmp_path / "afile", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_index(embedder, gallery, empty, progress=False).sidecar.count == 15


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path, gallery, embedder):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, progress=False)
    make_gallery(gallery, classes=1, per_class=2, seed=7)
    with IndexWriter(out):  # another process, as far as flock is concerned
        with pytest.raises(IndexLockedError, match=rf"being written by another process \(pid "
                                                   rf"{os.getpid()} holds '.*\.lock'\)"):
            add_mod.append_photos(embedder, out, gallery, progress=False)
        with pytest.raises(IndexLockedError):
            build_index(embedder, gallery, out, progress=False)
        assert load_index(out).sidecar.count == 15  # readers take no lock
    assert add_mod.append_photos(embedder, out, gallery, progress=False).added == 2


def test_versions_swap_through_the_pointer_and_old_ones_are_removed(tmp_path, gallery, embedder):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, dims=8, progress=False)
    first = current_version(out)
    assert (out / POINTER_FILE).read_text() == first.name + "\n"
    build_index(embedder, gallery, out, dims=6, progress=False)
    second = current_version(out)
    assert second != first and first.is_dir()  # kept for readers that followed the old pointer
    (out / ".tmp-0123456789abcdef0123456789abcdef").mkdir()  # left by a killed writer
    build_index(embedder, gallery, out, dims=4, progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".lock", POINTER_FILE, second.name, current_version(out).name])
    assert load_index(out).dims == 4


def test_a_reader_whose_version_is_removed_meanwhile_follows_the_new_pointer(
        tmp_path, gallery, embedder, monkeypatch):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, dims=8, progress=False)
    load_version = store_mod._load_version
    calls = []

    def two_writes_first(folder, version, *args):
        if not calls:  # between reading CURRENT and opening the files, two writers run
            for dims in (6, 4):
                build_index(embedder, gallery, out, dims=dims, progress=False)
            assert not version.exists()
        calls.append(version)
        return load_version(folder, version, *args)

    monkeypatch.setattr(store_mod, "_load_version", two_writes_first)
    assert load_index(out).dims == 4 and len(calls) == 2


def test_index_folders_of_earlier_code_are_refused_naming_the_fix(tmp_path, gallery, embedder):
    """Earlier layouts (the files directly in the folder), photo tables (meta.jsonl) and
    sidecars (format 1 with "L", or without the fields of this format) are refused, naming
    the folder and the rebuild; the rebuild may write over them."""
    out = tmp_path / "ix"
    fix = f"rebuild it: python -m index.build --model MODEL --photos DIR --out {out}"

    def refused(match):
        with pytest.raises(IndexCorruptError, match=match) as err:
            load_index(out)
        assert str(out) in str(err.value) and fix in str(err.value)

    build_index(embedder, gallery, out, progress=False)
    version = current_version(out)
    sidecar = version / SIDECAR_FILE
    raw = json.loads(sidecar.read_text())
    earlier = {**raw, "format": 1, "L": raw["width"]}
    del earlier["width"], earlier["modes"]
    sidecar.write_text(json.dumps(earlier))
    refused(r"written by earlier code \(sidecar format 1; this code reads format 4\)")
    sidecar.write_text(json.dumps({**raw, "format": 2}))  # before model bundles
    refused(r"written by earlier code \(sidecar format 2; this code reads format 4\)")
    sidecar.write_text(json.dumps({k: v for k, v in raw.items() if k not in ("recall", "params")}))
    refused(r"lacks fields \['params', 'recall'\]")
    sidecar.write_text(json.dumps(raw))
    to_meta_jsonl(version)
    for name in (INDEX_FILE, META_FILE, SIDECAR_FILE):  # the flat layout: files in the folder
        (version / name).rename(out / name)
    for p in (version, out / POINTER_FILE, out / ".lock"):
        p.rmdir() if p.is_dir() else p.unlink()
    refused("layout of earlier code")
    build_index(embedder, gallery, out, progress=False)  # the fix
    assert sorted(p.name for p in out.iterdir()) == [".lock", POINTER_FILE,
                                                     current_version(out).name]
    assert load_index(out).sidecar.count == 15


def test_a_sidecar_of_format_3_reads_as_mirror_averaged_photos(tmp_path, gallery, embedder):
    """Format 3 did not record the photos' views; that code always averaged each photo
    with its mirror image, so its indexes load (and append) as photo_views 2."""
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, progress=False)
    sidecar = current_version(out) / SIDECAR_FILE
    raw = json.loads(sidecar.read_text())
    assert raw["photo_views"] == 1  # this code's default
    del raw["photo_views"]
    sidecar.write_text(json.dumps({**raw, "format": 3}))
    loaded = load_index(out).sidecar
    assert (loaded.format, loaded.photo_views) == (store_mod.FORMAT_VERSION, 2)
    sidecar.write_text(json.dumps({**raw, "format": 3, "photo_views": 1}))  # not format 3's
    with pytest.raises(IndexCorruptError, match="sidecar format 3; this code reads format 4"):
        load_index(out)
    build_index(embedder, gallery, out, progress=False)  # the fix
    assert load_index(out).sidecar.photo_views == 1


def test_pointer_to_a_missing_or_odd_version_is_refused(tmp_path, gallery, embedder):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, progress=False)
    (out / POINTER_FILE).write_text("../../etc\n")
    with pytest.raises(IndexCorruptError, match="not a version name"):
        load_index(out)
    (out / POINTER_FILE).write_text("v-20240101T000000Z-0123456789ab\n")
    with pytest.raises(IndexCorruptError, match="which is missing"):
        load_index(out)


def test_build_skips_links_that_lead_outside_the_gallery(tmp_path, gallery, embedder):
    secret = tmp_path / "secret.jpg"
    Image.new("RGB", (8, 8)).save(secret)
    (gallery / "class0" / "leak.jpg").symlink_to(secret)
    (gallery / "class3").symlink_to(make_gallery(tmp_path / "elsewhere", classes=1) / "class0")
    (gallery / "class0" / "again.jpg").symlink_to(gallery / "class1" / "c1_0_000.jpg")
    report = build_index(embedder, gallery, tmp_path / "ix", progress=False)
    assert report.sidecar.count == 16  # the link inside the gallery is a photo
    assert report.skipped == {"links to files outside the folder": ["class0/leak.jpg"],
                              "linked folders": ["class3"]}
    paths = [p.path for p in load_index(tmp_path / "ix").photos]
    assert "class0/again.jpg" in paths and not any("leak" in p or "class3" in p for p in paths)


def test_append_refuses_photos_outside_the_index_photo_root(tmp_path, gallery, embedder):
    out = tmp_path / "ix"
    build_index(embedder, gallery, out, progress=False)
    other = make_gallery(tmp_path / "other", classes=1, per_class=2, seed=3)
    with pytest.raises(DataError, match=rf"photo '{other}/class0/c0_3_000.jpg' is outside the "
                                        rf"index's photo root '{gallery.resolve()}'"):
        add_mod.append_photos(embedder, out, other, progress=False)
    assert load_index(out).sidecar.count == 15
    make_gallery(gallery / "class0", classes=1, per_class=2, seed=3)  # below the root: fine
    report = add_mod.append_photos(embedder, out, gallery / "class0", progress=False)
    assert report.added == 2
    assert load_index(out).photos[-1].path == "class0/class0/c0_3_001.jpg"


def test_index_files_and_folders_are_readable_by_a_service_of_another_user(tmp_path, gallery,
                                                                          embedder):
    old = os.umask(0o022)
    try:
        build_index(embedder, gallery, tmp_path / "ix", progress=False)
    finally:
        os.umask(old)
    out = tmp_path / "ix"
    version = current_version(out)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [out, version, *out.iterdir(), *version.iterdir()]}
    assert modes == {
        "ix": 0o755, f"ix/{version.name}": 0o755, "ix/.lock": 0o644, "ix/CURRENT": 0o644,
        **{f"ix/{version.name}/{n}": 0o644 for n in (INDEX_FILE, SIDECAR_FILE, *TABLE_FILES)},
    }
