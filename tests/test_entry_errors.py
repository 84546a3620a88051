"""Every entry point, run as a user runs it: a mistake the user can fix ends in one line
``error: ...`` on stderr that names the thing, exit status 2 and no traceback; the
traceback comes back with ``--log-level debug``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("error: "), err
    for name in names:
        assert name in last, err
    return last


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.bundles import untrained_bundle

    return untrained_bundle(tmp_path_factory.mktemp("model"), modes=4, hidden=8,
                            image_size=64).path


def test_index_build_of_a_gallery_where_nothing_decodes(tmp_path, model):
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    (gallery / "a.jpg").write_bytes(b"not a jpeg")
    (gallery / "b.png").write_bytes(b"")
    argv = ["index.build", "--model", str(model), "--photos", str(gallery),
            "--out", str(tmp_path / "ix"), "--no-progress"]
    one_line_error(run(*argv, cwd=tmp_path), "none of the 2 photos", "a.jpg")
    debug = run(*argv, "--log-level", "debug", cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert not (tmp_path / "ix" / "CURRENT").exists()


def test_index_build_with_a_missing_model_or_a_checkpoint_for_one(tmp_path, small_gallery,
                                                                  model):
    one_line_error(run("index.build", "--model", str(tmp_path / "none"), "--photos",
                       str(small_gallery), "--out", str(tmp_path / "ix"), cwd=tmp_path),
                   "none", "python -m training.cdk")
    one_line_error(run("index.build", "--model", str(model.parent / "checkpoint.pt"),
                       "--photos", str(small_gallery), "--out", str(tmp_path / "ix"),
                       cwd=tmp_path), "checkpoint.pt", "python -m training.cdk.make_bundle")


def test_make_bundle_with_a_missing_checkpoint(tmp_path):
    one_line_error(run("training.cdk.make_bundle", "--checkpoint", str(tmp_path / "c.pt"),
                       cwd=tmp_path), "c.pt")


def test_index_add_to_a_locked_index(tmp_path, small_gallery, model):
    from index.store import IndexWriter

    out = tmp_path / "ix"
    build = run("index.build", "--model", str(model), "--photos", str(small_gallery),
                "--out", str(out), "--no-progress", cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    with IndexWriter(out, create=False):
        one_line_error(run("index.add", "--index", str(out), "--photos", str(small_gallery),
                           cwd=tmp_path), "lock", str(os.getpid()))


def test_training_cdk_with_a_folder_that_is_no_dataset(tmp_path):
    (tmp_path / "data" / "photo").mkdir(parents=True)
    one_line_error(run("training.cdk", "--data", str(tmp_path / "data"), "--out",
                       str(tmp_path / "run"), cwd=tmp_path), "sketch")


def test_training_cdk_with_a_bad_value(tmp_path):
    one_line_error(run("training.cdk", "--data", str(tmp_path), "--epochs", "0", cwd=tmp_path),
                   "epochs")


def test_training_pde_with_an_unknown_problem(tmp_path):
    one_line_error(run("training.pde", "helium", cwd=tmp_path), "helium")


def test_service_without_an_index(tmp_path):
    last = one_line_error(run("service", "--index", str(tmp_path / "none"), cwd=tmp_path),
                          "none")
    assert "python -m index.build" in last  # and the command that makes one


def test_demo_with_a_bad_flag(tmp_path):
    one_line_error(run("training.demo", "--nesting", "diagonal", cwd=tmp_path), "diagonal")


def test_quickstart_says_what_it_needs(tmp_path):
    """./quickstart DATA [PHOTOS] checks its arguments before it makes anything."""
    script = str(REPO / "quickstart")
    usage = subprocess.run([script], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "./quickstart DATA [PHOTOS]" in usage.stdout
    (tmp_path / "photos").mkdir()
    wrong = subprocess.run([script, str(tmp_path / "photos")], capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (f"error: {tmp_path / 'photos'} has no sketch/ and photo/ "
                                    'folders (README, "Data")')
    (tmp_path / "data" / "sketch").mkdir(parents=True)
    (tmp_path / "data" / "photo").mkdir()
    missing = subprocess.run([script, str(tmp_path / "data"), str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
