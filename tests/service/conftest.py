import io
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from index.build import build_index
from service.loading import open_current
from service.main import create_app
from service.retrieval import RetrievalEngine
from service.server import server_config
from service.settings import Settings
from tests.fakes import FakeModel, make_gallery


@pytest.fixture(scope="session")
def fake_index(tmp_path_factory):
    """A 3-class x 5-photo index built with the fake embedder (L=8, all dims stored)."""
    root = tmp_path_factory.mktemp("svc")
    photos = make_gallery(root / "photos", classes=3, per_class=5)
    embedder = FakeModel(L=8)
    build_index(embedder, photos, root / "index", progress=False)
    return root / "index", embedder


@pytest.fixture
def settings(fake_index):
    return Settings(index=fake_index[0], max_upload_bytes=200_000, max_pixels=1_000_000,
                    max_k=20, default_k=5, max_batch=4, cors_origins=["http://example.test"])


@pytest.fixture
def engine(fake_index, settings):
    index_dir, embedder = fake_index
    gallery, version = open_current(index_dir, embedder)
    return RetrievalEngine(embedder, gallery, settings.max_pixels, version=version)


@pytest.fixture
def client(settings, engine):
    app = create_app(settings, loader=lambda s: engine)
    with TestClient(app) as c:
        yield c


def sketch_png(seed=0, size=64) -> bytes:
    """A few random black strokes on white, PNG-encoded."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        draw.line([tuple(p) for p in rng.integers(0, size, (5, 2)).tolist()], fill="black",
                  width=3)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(app, settings):
    """Run `app` under the service's uvicorn config on 127.0.0.1 (a thread); yields its URL."""
    port = free_port()
    server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180  # the first start exports the encoder (slow when busy)
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        # uvicorn finishes the requests in flight first; a thread still running when pytest
        # closes its captured streams would log into a closed file
        thread.join(timeout=60)


@contextmanager
def service_process(index, *flags: str, _runner: str | None = None, **env: str):
    """`python -m service --index INDEX FLAGS` in its own process on 127.0.0.1; yields
    (url, process) once /health answers 200, and stops it after. Its output goes to a file
    (a pipe nobody reads would fill and stall the server), `process.output()` reads it.
    `_runner`: Python code run instead of `-m service` (with the same arguments), e.g. to
    install an audit hook first."""
    import os
    import subprocess
    import sys
    import tempfile

    import httpx

    from tests.conftest import REPO

    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, *(["-c", _runner] if _runner else ["-m", "service"]),
         "--index", str(index), "--port", str(port),
         "--host", "127.0.0.1", "--log-level", "warning", *flags],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=log, stderr=subprocess.STDOUT, text=True)

    def output() -> str:
        log.seek(0)
        return log.read()

    proc.output = output
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"service exited with {proc.returncode}: {output()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("service did not become healthy in 180 s")
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def live_server(real_index, small_gallery):
    """A real uvicorn server on 127.0.0.1 (thread) serving the real checkpoint and index."""
    settings = Settings(index=real_index, max_k=20, default_k=6)
    with serve(create_app(settings), settings) as url:
        yield url
