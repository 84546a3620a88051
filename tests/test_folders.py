"""training.folders: the one folder scanner, as training and the index see it."""

import re
from pathlib import Path

import pytest
from PIL import Image

from index.build import build_index
from index.gallery import scan_gallery
from index.store import load_index
from tests.fakes import FakeModel
from training.cdk.data import scan
from training.folders import (
    IMAGE_SUFFIXES,
    DataError,
    gallery_roots,
    scan_paired,
)
from training.images import FORMATS

OFFICIAL = "tx_000000000000"


def jpg(path: Path, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (value, value, value)).save(path, "JPEG")
    return path


def sketchy_extended(root: Path, extended: str = "extended_photo") -> Path:
    """Two classes in the official layout, one extra photo each in the extended folder."""
    for c in ("cat", "dog"):
        for i in range(2):
            jpg(root / "photo" / OFFICIAL / c / f"{c}{i}.jpg", 40 * i)
            jpg(root / "sketch" / OFFICIAL / c / f"{c}{i}-1.png")
        jpg(root / extended / c / f"ext_{c}.jpg", 200)
    return root


def test_suffixes_are_those_of_the_decoder_formats():
    known = Image.registered_extensions()
    assert {known[s] for s in IMAGE_SUFFIXES} == set(FORMATS)


@pytest.mark.parametrize("extended", ["extended_photo", "EXTEND_image_sketchy"])
def test_sketchy_extended_for_training(tmp_path, extended):
    sketches, photos = scan_paired(sketchy_extended(tmp_path, extended))
    assert list(sketches) == list(photos) == ["cat", "dog"]
    assert [p.name for p in photos["cat"]] == ["cat0.jpg", "cat1.jpg", "ext_cat.jpg"]
    assert photos["cat"][2].parent == tmp_path / extended / "cat"
    assert [s.name for s in sketches["dog"]] == ["dog0-1.png", "dog1-1.png"]


def test_index_build_reads_sketchy_extended(tmp_path):
    root = sketchy_extended(tmp_path / "sketchy")
    (root / "README.txt").write_text("files beside the class folders are not photos")
    out = build_index(FakeModel(L=4), root, tmp_path / "ix", progress=False).out
    ix = load_index(out, FakeModel(L=4).sha256)
    assert ix.sidecar.count == 6 and Path(ix.sidecar.photos_root) == root.resolve()
    assert sorted({p.cls for p in ix.photos}) == ["cat", "dog"]
    by_id = {p.id: p for p in ix.photos}
    ext = by_id["ext_dog"]
    assert (ext.cls, ext.path) == ("dog", "extended_photo/dog/ext_dog.jpg")
    assert by_id["cat1"].path == f"photo/{OFFICIAL}/cat/cat1.jpg"
    assert all(ix.photo_path(p).is_file() for p in ix.photos)
    # The photo/ folder of the official layout on its own is a gallery too.
    assert gallery_roots(root / "photo") == [root / "photo" / OFFICIAL]
    scan = scan_gallery(root / "photo")
    _, photos = scan.root, scan.photos
    assert [p.id for p in photos] == ["cat0", "cat1", "dog0", "dog1"]


def test_layouts_of_a_gallery(tmp_path):
    jpg(tmp_path / "plain" / "a" / "x.jpg")
    assert gallery_roots(tmp_path / "plain") == [tmp_path / "plain"]
    jpg(tmp_path / "pair" / "photo" / "a" / "x.jpg")
    jpg(tmp_path / "pair" / "sketch" / "a" / "x-1.png")
    scan_pair = scan_gallery(tmp_path / "pair")
    assert scan_pair.root == (tmp_path / "pair" / "photo").resolve()
    assert [(p.cls, p.path) for p in scan_pair.photos] == [("a", "a/x.jpg")]


def stray_cases(tmp_path: Path):
    """(name, gallery folder, paired folder, offending path) for each kind of stray entry."""
    for name, make in (("text", lambda d: (d / "notes.txt").write_text("x")),
                       ("subfolder", lambda d: (d / "more").mkdir()),
                       ("no_suffix", lambda d: (d / "photo").write_bytes(b"x"))):
        paired = tmp_path / name
        jpg(paired / "photo" / "a" / "a0.jpg")
        jpg(paired / "sketch" / "a" / "a0-1.png")
        make(paired / "photo" / "a")
        offending = next(p for p in (paired / "photo" / "a").iterdir() if p.name != "a0.jpg")
        yield name, paired, offending


def test_stray_entries_are_errors_in_training_and_skipped_in_a_gallery(tmp_path):
    """Training data must be exactly what it says (a stray file is an error naming it); a
    photo folder is the user's (a stray file is skipped and counted)."""
    for name, paired, offending in stray_cases(tmp_path):
        with pytest.raises(DataError, match=re.escape(f"unexpected entry '{offending}'")):
            scan(paired)
        for folder in (paired, paired / "photo"):  # the same folder as a plain gallery
            found = scan_gallery(folder)
            assert [p.path for p in found.photos] == ["a/a0.jpg"], name
            if name != "subfolder":  # an empty folder holds nothing to skip
                assert found.skipped == {"files that are not images": [
                    f"a/{offending.name}"]}, name
        offending.unlink() if offending.is_file() else offending.rmdir()
        assert len(scan(paired).photos) == 1 and len(scan_gallery(paired).photos) == 1, name


def test_hidden_entries_are_ignored_everywhere(tmp_path):
    jpg(tmp_path / "photo" / "a" / "a0.jpg")
    jpg(tmp_path / "sketch" / "a" / "a0-1.png")
    (tmp_path / "photo" / "a" / ".DS_Store").write_bytes(b"x")
    (tmp_path / "sketch" / "a" / ".a0-1.png.swp").write_bytes(b"x")
    (tmp_path / "photo" / ".cache").mkdir()
    assert len(scan(tmp_path).sketches) == 1
    assert [p.id for p in scan_gallery(tmp_path).photos] == ["a0"]


def test_one_sided_and_empty_classes_name_the_folder(tmp_path):
    root = sketchy_extended(tmp_path / "one_side")
    jpg(root / "extended_photo" / "emu" / "e.jpg")
    with pytest.raises(DataError, match="extended_photo/emu has no sketch class"):
        scan_paired(root)
    root = sketchy_extended(tmp_path / "empty")
    (root / "sketch" / OFFICIAL / "emu").mkdir()
    jpg(root / "photo" / OFFICIAL / "emu" / "e.jpg")
    with pytest.raises(DataError, match=rf"empty class: no sketches in .*{OFFICIAL}/emu"):
        scan_paired(root)
    with pytest.raises(DataError, match="has no sketch/ subfolder"):
        scan_paired(root / "photo")
