"""A writer SIGKILLed at any disk-changing step of index.build or index.add leaves a loadable
index, the old one or the new one, and the next writer succeeds and cleans up after it.

The kill points are enumerated, not sampled: tests/index/kill_worker.py kills the writer just
before its 1st, 2nd, ... call that changes the disk until the writer finishes untouched.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from index.add import append_photos
from index.build import build_index
from index.errors import IndexStoreError
from index.store import (
    LOCK_FILE,
    POINTER_FILE,
    VERSION_NAME,
    current_version,
    load_index,
)
from tests.fakes import FakeModel, make_gallery

REPO = Path(__file__).resolve().parents[2]


def snapshot(folder: Path) -> tuple:
    """Everything a reader sees: count, dims, photo table and the stored vectors."""
    ix = load_index(folder)
    assert ix.index.ntotal == len(ix.photos) == ix.sidecar.count
    return (ix.sidecar.count, ix.dims, tuple(ix.photos),
            ix.index.reconstruct_n(0, len(ix)).tobytes())


def check_clean_after_next_write(run: Path, write) -> None:
    """The lock died with the killed writer; the next write leaves no temporaries."""
    write(run)
    names = {p.name for p in run.iterdir()}
    versions = {n for n in names if VERSION_NAME.match(n)}
    assert names - versions == {POINTER_FILE, LOCK_FILE}, names
    assert current_version(run).name in versions and len(versions) <= 2


SCENARIOS = [("build", "versioned"), ("add", "versioned"), ("build", "none")]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory) -> dict:
    """{(writer, layout): (gallery, old snapshot or None, runs folder, worker result)}."""
    embedder = FakeModel(L=8)
    jobs, prepared = [], {}
    for writer, layout in SCENARIOS:
        root = tmp_path_factory.mktemp(f"{writer}-{layout}")
        gallery = make_gallery(root / "photos", classes=3, per_class=5)
        pristine = None
        if layout != "none":
            pristine = root / "pristine"
            build_index(embedder, gallery, pristine, dims=8, progress=False)
        if writer == "add":
            make_gallery(gallery, classes=2, per_class=3, seed=1)  # 6 photos to append
        (root / "runs").mkdir()
        jobs.append({"writer": writer, "pristine": pristine and str(pristine),
                     "gallery": str(gallery), "runs": str(root / "runs")})
        prepared[writer, layout] = (gallery, pristine and snapshot(pristine), root / "runs")
    spec = tmp_path_factory.mktemp("jobs") / "jobs.json"
    spec.write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, "-m", "tests.index.kill_worker", str(spec)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    return {key: (*prepared[key], res) for key, res in zip(SCENARIOS, results, strict=True)}


@pytest.fixture
def embedder():
    return FakeModel(L=8)


@pytest.mark.parametrize(("writer", "layout"), SCENARIOS[:2])
def test_killed_writer_leaves_the_old_or_the_new_index(killed_runs, embedder, writer, layout):
    gallery, old, runs, result = killed_runs[writer, layout]
    new = snapshot(runs / f"run-{result['finished']:03d}")
    assert (new[0], new[1]) == ((15, 4) if writer == "build" else (21, 8))
    seen = []
    for n in result["killed"]:
        run = runs / f"run-{n:03d}"
        state = snapshot(run)
        assert state in (old, new), f"kill point {n}: neither the old nor the new index"
        seen.append("old" if state == old else "new")
        if writer == "build":
            check_clean_after_next_write(
                run, lambda out: build_index(embedder, gallery, out, progress=False))
        else:
            check_clean_after_next_write(
                run, lambda out: append_photos(embedder, out, gallery, progress=False))
            assert snapshot(run) == new
    # The kill points span the swap: before it readers get the old index, after it the new.
    assert len(seen) >= 10 and seen[0] == "old" and seen[-1] == "new", seen
    assert seen == sorted(seen, key=["old", "new"].index), seen


def test_killed_first_build_leaves_no_index_or_the_new_one(killed_runs, embedder):
    gallery, _, runs, result = killed_runs["build", "none"]
    new = snapshot(runs / f"run-{result['finished']:03d}")
    outcomes = []
    for n in result["killed"]:
        run = runs / f"run-{n:03d}"
        try:
            state = snapshot(run)
        except IndexStoreError:
            outcomes.append("none")
        else:
            assert state == new, f"kill point {n}"
            outcomes.append("new")
        if run.exists():
            check_clean_after_next_write(
                run, lambda out: build_index(embedder, gallery, out, progress=False))
    assert outcomes[0] == "none" and outcomes[-1] == "new", outcomes
    assert outcomes == sorted(outcomes, key=["none", "new"].index), outcomes
