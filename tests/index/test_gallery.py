import pytest
from PIL import Image

from index.embed import embed_photos
from index.gallery import scan_gallery
from tests.fakes import FakeEmbedder, make_gallery
from training.folders import DataError


def test_paired_folder_uses_its_photo_side(tmp_path):
    make_gallery(tmp_path / "pair" / "photo", classes=2, per_class=2)
    (tmp_path / "pair" / "sketch" / "class0").mkdir(parents=True)
    root, photos = scan_gallery(tmp_path / "pair")
    assert root == (tmp_path / "pair" / "photo").resolve()
    assert [(p.cls, p.path) for p in photos][:2] == [
        ("class0", "class0/c0_0_000.jpg"), ("class0", "class0/c0_0_001.jpg")]


def test_sketchy_mini_layout(sketchy_mini):
    root, photos = scan_gallery(sketchy_mini)
    assert root.name == "photo" and len(photos) == 3125
    assert len({p.cls for p in photos}) == 125


def test_duplicate_ids_and_empty_folders_are_errors(tmp_path):
    for c in ("a", "b"):
        (tmp_path / "dup" / c).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "dup" / c / "same.jpg")
    with pytest.raises(DataError, match="'same' is used by both 'a/same.jpg' and 'b/same.jpg'"):
        scan_gallery(tmp_path / "dup")
    (tmp_path / "badid" / "a").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "badid" / "a" / "-x.jpg")
    with pytest.raises(DataError, match="'-x'"):
        scan_gallery(tmp_path / "badid")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class subfolders"):
        scan_gallery(tmp_path / "empty")
    (tmp_path / "noimg" / "c").mkdir(parents=True)
    with pytest.raises(DataError, match="no images"):
        scan_gallery(tmp_path / "noimg")
    with pytest.raises(DataError, match="missing"):
        scan_gallery(tmp_path / "missing")


def test_unreadable_photo_is_named(tmp_path):
    make_gallery(tmp_path, classes=1, per_class=2)
    (tmp_path / "class0" / "c0_0_001.jpg").write_bytes(b"not a jpeg")
    root, photos = scan_gallery(tmp_path)
    with pytest.raises(ValueError, match="c0_0_001.jpg"):
        embed_photos(FakeEmbedder(L=4), root, photos, progress=False)
