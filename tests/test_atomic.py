import pytest
import torch

from training.atomic import atomic_save, atomic_write_text


def test_writes_and_replaces(tmp_path):
    path = tmp_path / "sub" / "ckpt.pt"
    atomic_save({"w": torch.arange(3)}, path)
    atomic_save({"w": torch.arange(4)}, path)
    assert torch.equal(torch.load(path)["w"], torch.arange(4))
    atomic_write_text("hello", tmp_path / "m.json")
    assert (tmp_path / "m.json").read_text() == "hello"


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "m.json"
    atomic_write_text("old", path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save(Boom(), path)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
