"""Run an index writer and SIGKILL it before its n-th filesystem step, for n = 0, 1, ...

    python -m tests.index.kill_worker JOBS.json

JOBS.json is a list of {"writer": "build" | "add", "pristine": index folder or null,
"gallery": photo folder, "runs": folder}. For each job and each n, the pristine index is
copied to RUNS/run-<n>, a forked child runs the writer on it and kills itself just before its
n-th call of a function that changes the disk (mkdir, open, write, fsync, rename, unlink,
rmdir, flock, faiss.write_index) made from index/store.py, directly or through
pathlib/shutil/training. A job ends at the first n the writer finishes without reaching.
Prints one JSON list of {"killed": [n, ...], "finished": n}, one per job; the checks of every
RUNS/run-<n> are in tests/index/test_crash.py. One process runs all jobs: imports take longer
than the kills.
"""

from __future__ import annotations

import builtins
import fcntl
import io
import json
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children fork: no thread pools, please

import faiss  # noqa: E402
import torch  # noqa: E402

import index.store  # noqa: E402
from index.add import append_photos  # noqa: E402
from index.build import build_index  # noqa: E402
from tests.fakes import FakeModel  # noqa: E402

MAX_STEPS = 300
STORE = index.store.__file__


def _from_store() -> bool:
    frame = sys._getframe(2)
    for _ in range(8):  # store -> pathlib/shutil/training.files -> os (rmtree recurses a bit)
        if frame is None:
            return False
        if frame.f_code.co_filename == STORE:
            return True
        frame = frame.f_back
    return False


def install_kill_point(n: int) -> None:
    """Kill this process just before the n-th disk-changing call made for index.store."""
    count = 0

    def wrap(fn):
        def step(*args, **kwargs):
            nonlocal count
            if _from_store():
                if count == n:
                    os.kill(os.getpid(), signal.SIGKILL)
                count += 1
            return fn(*args, **kwargs)

        return step

    for name in ("mkdir", "open", "write", "pwrite", "ftruncate", "fsync", "rename", "replace",
                 "unlink", "rmdir"):
        setattr(os, name, wrap(getattr(os, name)))
    builtins.open = io.open = wrap(builtins.open)
    fcntl.flock = wrap(fcntl.flock)
    faiss.write_index = wrap(faiss.write_index)


def run_writer(kind: str, out: Path, gallery: Path) -> None:
    embedder = FakeModel(L=8)
    if kind == "build":
        build_index(embedder, gallery, out, dims=4, progress=False)
    else:
        append_photos(embedder, out, gallery, progress=False)


def kill_everywhere(writer: str, pristine: str | None, gallery: str, runs: str) -> dict:
    killed = []
    for n in range(MAX_STEPS):
        out = Path(runs) / f"run-{n:03d}"
        if pristine is not None:
            shutil.copytree(pristine, out, symlinks=True)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                install_kill_point(n)
                run_writer(writer, out, Path(gallery))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            killed.append(n)
            continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return {"killed": killed, "finished": n}
        raise RuntimeError(f"writer at kill point {n} failed with status {status}")
    raise RuntimeError(f"writer still running after {MAX_STEPS} kill points")


if __name__ == "__main__":
    torch.set_num_threads(1)
    jobs = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps([kill_everywhere(**job) for job in jobs]))
