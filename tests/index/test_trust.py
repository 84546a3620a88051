"""What an index folder holds is checked, not trusted: every file of a version against the
sha256 its sidecar lists, before FAISS or the table reader opens it; links refused (the
photo folder fixed at start: tests/service/test_reload.py)."""

import json
import os
import shutil

import faiss
import numpy as np
import pytest

from index.build import build_index
from index.errors import IndexCorruptError
from index.store import INDEX_FILE, POINTER_FILE, SIDECAR_FILE, current_version, load_index
from tests.fakes import FakeModel, make_gallery


@pytest.fixture
def built(tmp_path):
    photos = make_gallery(tmp_path / "photos", classes=2, per_class=3)
    model = FakeModel(L=8)
    build_index(model, photos, tmp_path / "index", progress=False)
    return tmp_path, model


def test_the_sidecar_lists_every_file_with_its_sha256(built):
    folder, _ = built
    version = current_version(folder / "index")
    sidecar = json.loads((version / SIDECAR_FILE).read_text())
    assert set(sidecar["files"]) == {p.name for p in version.iterdir()} - {SIDECAR_FILE}
    import hashlib

    for name, entry in sidecar["files"].items():
        data = (version / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_a_planted_faiss_file_is_refused_before_faiss_reads_it(built, monkeypatch):
    folder, model = built
    version = current_version(folder / "index")
    planted = faiss.IndexFlatIP(8)  # a valid index that ranks one photo first for anything
    planted.add(np.tile(np.eye(8, dtype=np.float32)[:1] * 100, (6, 1)))
    faiss.write_index(planted, str(version / INDEX_FILE))
    read = []
    monkeypatch.setattr(faiss, "read_index", lambda *a: read.append(a))
    with pytest.raises(IndexCorruptError, match="index.faiss' is not the file the sidecar lists"):
        load_index(folder / "index", model_sha256=model.sha256)
    assert read == []  # refused before FAISS opened it


def test_an_extra_file_or_a_link_in_a_version_is_refused(built, tmp_path):
    folder, _ = built
    version = current_version(folder / "index")
    (version / "extra.onnx").write_bytes(b"x")
    with pytest.raises(IndexCorruptError, match=r"does not list \['extra.onnx'\]"):
        load_index(folder / "index")
    (version / "extra.onnx").unlink()
    table = version / "photos.json"
    moved = tmp_path / "photos.json"
    shutil.move(table, moved)
    table.symlink_to(moved)  # the same bytes, through a link
    with pytest.raises(IndexCorruptError, match="photos.json' is a link"):
        load_index(folder / "index")


def test_a_version_that_is_a_link_is_refused(built, tmp_path):
    folder, _ = built
    version = current_version(folder / "index")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(version, elsewhere)
    name = "v-20300101T000000Z-0123456789ab"
    os.symlink(elsewhere, folder / "index" / name)
    (folder / "index" / POINTER_FILE).write_text(name + "\n")
    with pytest.raises(IndexCorruptError, match="which is a link"):
        load_index(folder / "index")
