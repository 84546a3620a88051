import io
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from index.build import build_index
from index.store import load_index
from service.engine import RetrievalEngine
from service.main import create_app
from service.settings import Settings
from tests.fakes import FakeEmbedder, make_gallery


@pytest.fixture(scope="session")
def fake_index(tmp_path_factory):
    """A 3-class x 5-photo index built with the fake embedder (L=8, all dims stored)."""
    root = tmp_path_factory.mktemp("svc")
    photos = make_gallery(root / "photos", classes=3, per_class=5)
    embedder = FakeEmbedder(L=8)
    build_index(embedder, photos, root / "index", root / "ckpt.pt", progress=False)
    return root / "index", embedder


@pytest.fixture
def settings(fake_index):
    return Settings(index=fake_index[0], max_upload_bytes=200_000, max_pixels=1_000_000,
                    max_k=20, default_k=5, max_batch=4, cors_origins=["http://example.test"])


@pytest.fixture
def engine(fake_index, settings):
    index_dir, embedder = fake_index
    return RetrievalEngine(embedder, load_index(index_dir, embedder.checkpoint_sha256),
                           settings.max_pixels)


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


@pytest.fixture(scope="module")
def live_server(real_index, small_gallery):
    """A real uvicorn server on 127.0.0.1 (thread) serving the real checkpoint and index."""
    settings = Settings(index=real_index, max_k=20, default_k=6)
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
