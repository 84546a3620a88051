"""Any folder of photos is a gallery: flat or nested, names with spaces or non-ASCII letters,
stray files skipped and counted, undecodable photos left out and listed."""

import re

import pytest
from PIL import Image

from index.build import build_index, main
from index.embed import embed_photos
from index.gallery import ID_PATTERN, path_hash, photo_id, scan_gallery, unique_ids
from index.store import load_index
from tests.fakes import FakeModel, make_gallery
from training.folders import DataError


def test_paired_folder_uses_its_photo_side(tmp_path):
    make_gallery(tmp_path / "pair" / "photo", classes=2, per_class=2)
    (tmp_path / "pair" / "sketch" / "class0").mkdir(parents=True)
    scan = scan_gallery(tmp_path / "pair")
    assert scan.root == (tmp_path / "pair" / "photo").resolve()
    assert [(p.cls, p.path) for p in scan.photos][:2] == [
        ("class0", "class0/c0_0_000.jpg"), ("class0", "class0/c0_0_001.jpg")]


def test_sketchy_mini_layout(sketchy_mini):
    scan = scan_gallery(sketchy_mini)
    assert scan.root.name == "photo" and len(scan.photos) == 3125 and not scan.skipped
    assert len({p.cls for p in scan.photos}) == 125
    assert all(p.id == p.path.split("/")[1][:-4] for p in scan.photos)  # stems kept as ids


def _image(path, colour=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (12, 12), colour).save(path)


def test_flat_nested_and_odd_names(tmp_path):
    g = tmp_path / "g"
    _image(g / "jellyfish 1.jpg")
    _image(g / "café au lait.png")
    _image(g / "ok_name.jpg")
    _image(g / "trips" / "2024" / "beach day.JPG")  # class: the first level below the folder
    _image(g / "trips" / "ok_name.jpg")  # the same stem as a photo at the top
    (g / "notes.txt").write_text("not a photo")
    (g / ".DS_Store").write_bytes(b"\0")  # hidden: ignored, not counted
    scan = scan_gallery(g)
    by_path = {p.path: p for p in scan.photos}
    assert sorted(by_path) == ["café au lait.png", "jellyfish 1.jpg", "ok_name.jpg",
                               "trips/2024/beach day.JPG", "trips/ok_name.jpg"]
    assert {p: by_path[p].cls for p in by_path} == {
        "café au lait.png": "", "jellyfish 1.jpg": "", "ok_name.jpg": "",
        "trips/2024/beach day.JPG": "trips", "trips/ok_name.jpg": "trips"}
    assert scan.skipped == {"files that are not images": ["notes.txt"]}
    assert "skipped 1 files that are not images ('notes.txt')" in scan.summary()
    ids = {p: by_path[p].id for p in by_path}
    assert all(ID_PATTERN.match(i) for i in ids.values())
    assert ids["jellyfish 1.jpg"] == f"jellyfish-1-{path_hash('jellyfish 1.jpg')}"
    assert ids["café au lait.png"] == f"cafe-au-lait-{path_hash('café au lait.png')}"
    # a stem two photos share: each gets its path's hash
    assert ids["ok_name.jpg"] == f"ok_name-{path_hash('ok_name.jpg')}"
    assert ids["trips/ok_name.jpg"] == f"ok_name-{path_hash('trips/ok_name.jpg')}"
    assert scan_gallery(g).photos == scan.photos  # stable


def test_ids_are_stable_and_safe():
    assert photo_id("a/n02691156_10151.jpg") == "n02691156_10151"
    for rel in ("-x.jpg", "日本.jpg", "a b/c d.png", "x" * 300 + ".jpg", "..jpg"):
        pid = photo_id(rel)
        assert ID_PATTERN.match(pid) and pid == photo_id(rel), rel
        assert re.fullmatch(r".*-[0-9a-f]{8}", pid), pid
    assert photo_id("日本.jpg") == f"photo-{path_hash('日本.jpg')}"
    assert unique_ids(["a/x.jpg", "b/x.jpg", "y.jpg"]) == [
        f"x-{path_hash('a/x.jpg')}", f"x-{path_hash('b/x.jpg')}", "y"]


def test_empty_and_missing_folders_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no images"):
        scan_gallery(tmp_path / "empty")
    (tmp_path / "noimg" / "c").mkdir(parents=True)
    (tmp_path / "noimg" / "c" / "readme.md").write_text("x")
    with pytest.raises(DataError, match="holds no images"):
        scan_gallery(tmp_path / "noimg")
    with pytest.raises(DataError, match="missing"):
        scan_gallery(tmp_path / "missing")


def test_an_undecodable_photo_is_left_out_and_listed(tmp_path, capsys):
    make_gallery(tmp_path / "g", classes=1, per_class=3)
    (tmp_path / "g" / "class0" / "c0_0_001.jpg").write_bytes(b"not a jpeg")
    scan = scan_gallery(tmp_path / "g")
    part = embed_photos(FakeModel(L=4), scan.root, scan.photos, progress=False)
    assert [p.id for p in part.photos] == ["c0_0_000", "c0_0_002"]
    assert part.vectors.shape == (2, 4)
    assert [(p.id, "c0_0_001.jpg" in why) for p, why in part.failed] == [("c0_0_001", True)]
    report = build_index(FakeModel(L=4), tmp_path / "g", tmp_path / "ix", progress=False)
    assert report.sidecar.count == 2 and report.failed[0][0] == "class0/c0_0_001.jpg"
    assert [p.id for p in load_index(tmp_path / "ix").photos] == ["c0_0_000", "c0_0_002"]


def test_cli_summary_names_what_was_skipped_and_left_out(tmp_path, monkeypatch, capsys):
    import index.build as build_mod

    monkeypatch.setattr(build_mod.Bundle, "open", lambda path: FakeModel(L=4))
    g = tmp_path / "g"
    _image(g / "a photo.jpg")
    _image(g / "another.png", (0, 0, 200))
    (g / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    (g / "list.txt").write_text("x")
    assert main(["--model", "m", "--photos", str(g), "--out", str(tmp_path / "ix"),
                 "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 photos, kind=flat" in out
    assert "skipped 1 files that are not images: list.txt" in out
    assert "left out broken.jpg:" in out


def test_reuse_keeps_a_current_index_and_rebuilds_a_stale_one(tmp_path, monkeypatch, capsys):
    import index.build as build_mod
    from index.store import current_version

    model = FakeModel(L=4)
    monkeypatch.setattr(build_mod.Bundle, "open", lambda path: model)
    g = make_gallery(tmp_path / "g", classes=2, per_class=2)
    argv = ["--model", "m", "--photos", str(g), "--out", str(tmp_path / "ix"), "--no-progress",
            "--threads", "1", "--reuse"]
    assert main(argv) == 0 and "2 classes" not in capsys.readouterr().out
    first = current_version(tmp_path / "ix")
    assert main(argv) == 0 and "kept" in capsys.readouterr().out
    assert current_version(tmp_path / "ix") == first  # nothing written
    _image(g / "class0" / "new.jpg")
    assert main(argv) == 0 and "5 photos, kind=flat" in capsys.readouterr().out
    assert current_version(tmp_path / "ix") != first
    model = FakeModel(L=4, seed=1)  # another model: built again
    assert main(argv) == 0 and "kept" not in capsys.readouterr().out
