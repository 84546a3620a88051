import os
import stat

import pytest
import torch

from training.files import atomic_save, atomic_write_text


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


def test_savefig_writes_a_png_and_closes_the_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from training.files import atomic_savefig

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = atomic_savefig(fig, tmp_path / "curve.png", dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600)])
def test_files_are_readable_by_others_as_the_umask_allows(tmp_path, umask, expected):
    old = os.umask(umask)
    try:
        atomic_save({"w": torch.arange(3)}, tmp_path / "ckpt.pt")
        atomic_write_text("{}", tmp_path / "metrics.json")
    finally:
        os.umask(old)
    for name in ("ckpt.pt", "metrics.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, name
