"""The edge under hostile but legal clients, over real HTTP on 127.0.0.1: body limits refused
before the body is sent, header and body deadlines, the admission cap (503 + Retry-After),
/health under load, log lines that cannot be forged, and one error shape."""

import asyncio
import logging
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.main import create_app
from service.settings import MULTIPART_OVERHEAD, Settings
from tests.service.conftest import serve, service_process, sketch_png


@pytest.fixture
def edge_settings(fake_index):
    return Settings(index=fake_index[0], max_upload_bytes=200_000, max_pixels=1_000_000,
                    max_k=20, default_k=5, max_batch=4, header_timeout=0.5, body_timeout=0.5,
                    max_pending=256)


def exchange(url: str, data: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """Send raw bytes and read until the server closes; (reply, seconds until closed)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except TimeoutError:
            pytest.fail(f"connection still open after {timeout}s; got {reply[:200]!r}")
    return reply, time.monotonic() - start


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def upload_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
            "Content-Type: multipart/form-data; boundary=xyz\r\n\r\n").encode()


def test_declared_oversize_body_is_refused_before_it_is_sent(fake_index, edge_settings):
    one_file = edge_settings.max_upload_bytes + MULTIPART_OVERHEAD
    assert one_file + 1 < edge_settings.max_body_bytes  # under the batch budget, over /retrieve's
    with serve(create_app(edge_settings, loader=lambda s: fake_engine(fake_index)),
               edge_settings) as url:
        # Headers only: the 413 must come without waiting for a body that never comes.
        for path, length, limit in [("/retrieve", one_file + 1, one_file),
                                    ("/retrieve/batch", edge_settings.max_body_bytes + 1,
                                     edge_settings.max_body_bytes),
                                    ("/health", 100_000, 64 * 1024)]:
            reply, seconds = exchange(url, upload_head(path, length))
            assert status_of(reply) == 413, reply
            assert f"is over the limit of {limit}".encode() in reply
            assert seconds < 2


def test_stalled_headers_are_closed_and_a_stalled_body_is_408(fake_index, edge_settings):
    with serve(create_app(edge_settings, loader=lambda s: fake_engine(fake_index)),
               edge_settings) as url:
        reply, seconds = exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line
        assert reply == b"" and 0.4 < seconds < 3  # header_timeout=0.5
        reply, seconds = exchange(url, upload_head("/retrieve", 1000) + b"--xyz\r\n")
        assert status_of(reply) == 408 and b"not received within 0.5s" in reply, reply
        assert seconds < 3
        assert httpx.get(f"{url}/health").status_code == 200


def fake_engine(fake_index, delay: float = 0.0, gate: threading.Event | None = None):
    """The fake-embedder engine; each retrieval waits for `gate` and sleeps `delay`."""
    from index.store import load_index
    from service.retrieval import RetrievalEngine

    index_dir, embedder = fake_index
    engine = RetrievalEngine(embedder, load_index(index_dir, embedder.checkpoint_sha256),
                             1_000_000)
    retrieve = engine.retrieve

    def slow_retrieve(*args):
        if gate is not None:
            gate.wait(timeout=30)
        time.sleep(delay)
        return retrieve(*args)

    engine.retrieve = slow_retrieve
    return engine


def test_admission_cap_answers_503_with_retry_after(fake_index, edge_settings):
    settings = edge_settings.model_copy(update={"max_pending": 2, "inference_slots": 1})
    gate = threading.Event()
    app = create_app(settings, loader=lambda s: fake_engine(fake_index, gate=gate))
    png = sketch_png()
    with serve(app, settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        results = []
        senders = [threading.Thread(target=lambda: results.append(http.post(
            "/retrieve", files={"file": ("s.png", png, "image/png")}).status_code))
            for _ in range(2)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 10
        while app.state.slots.borrowed_tokens < 1 or time.monotonic() < deadline - 9.5:
            assert time.monotonic() < deadline, "the first retrieval never started"
            time.sleep(0.02)
        r = http.post("/retrieve", files={"file": ("s.png", png, "image/png")})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json() == {"detail": "busy: 2 retrievals in progress; retry after 1s"}
        assert http.get("/health").status_code == 200  # not counted against the cap
        gate.set()
        for t in senders:
            t.join(timeout=30)
        assert results == [200, 200]
        assert http.post("/retrieve", files={"file": ("s.png", png, "image/png")}
                         ).status_code == 200


def probe_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """GET /health every 20 ms on one kept-alive raw connection until `stop` (a thread of its
    own, so the latency is the server's, not the load client's event loop)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b'{"status":"ok"}'):
                chunk = s.recv(4096)
                assert chunk, f"connection closed; got {reply!r}"
                reply += chunk
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)


def test_health_stays_fast_with_200_retrievals_in_flight(real_index, small_sketches):
    n = 200

    async def load(url):
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            posts = [http.post("/retrieve", files={
                "file": ("s.png", small_sketches[i % len(small_sketches)], "image/png")})
                for i in range(n)]
            return [r.status_code for r in await asyncio.gather(*posts)]

    # Its own process, as deployed: the load client does not hold the server's GIL.
    with service_process(real_index, "--max-pending", str(n)) as (url, _):
        stop, latencies = threading.Event(), []
        prober = threading.Thread(target=probe_health, args=(url, stop, latencies))
        prober.start()
        try:
            codes = asyncio.run(load(url))
        finally:
            stop.set()
            prober.join(timeout=30)
        after = httpx.get(f"{url}/health").status_code
    p99 = float(np.percentile(latencies, 99))
    print(f"/health with {n} retrievals in flight: {len(latencies)} probes, "
          f"p50 {1000 * np.median(latencies):.1f} ms, p99 {1000 * p99:.1f} ms")
    assert codes == [200] * n and after == 200
    assert len(latencies) >= 10
    # What this guards against: /health waiting for the pool that retrievals fill (p99 was
    # 3.7 s then). Measured since: p99 148-175 ms, once 308, with the load client on the same
    # 2 cores. The bound sits between the two, 3.7x under the failure it is for.
    assert p99 < 1.0, p99


def test_control_characters_in_paths_are_escaped_in_the_log(client, caplog):
    with caplog.at_level(logging.INFO, logger="service.access"):
        client.get("/photos/x%0A127.0.0.1 GET /admin 200 1.0ms%00%1b[31m")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "service.access"]
    assert "\n" not in line and "\x00" not in line and "\x1b" not in line
    assert line.startswith("GET /photos/x\\x0a127.0.0.1 GET /admin 200 1.0ms\\x00\\x1b[31m 404 ")


def test_a_field_without_filename_is_not_echoed(client):
    secret = b"\x89PNG-the-uploaded-bytes-" + b"s3cr3t" * 10
    r = client.post("/retrieve", files={"file": (None, secret)})
    assert r.status_code == 422 and b"s3cr3t" not in r.content
    assert r.json() == {"detail": "body.file: Value error, Expected UploadFile, received: "
                                  "<class 'str'>"}


def test_every_error_has_one_shape(client, settings):
    answers = [
        client.get("/no/such/route"),
        client.delete("/retrieve"),
        client.post("/retrieve", files={"file": ("s.png", b"", "image/png")}),
        client.post("/retrieve", files={"file": ("s.png", b"text", "image/png")}),
        client.post("/retrieve", params={"k": "x"}, files={"file": ("s.png", b"", "image/png")}),
        client.post("/retrieve", content=b"0" * (settings.max_body_bytes + 1)),
        client.post("/retrieve", params={"dims": 99}, files={"file": ("s.png", sketch_png())}),
        client.get("/photos/nope"),
    ]
    assert [a.status_code for a in answers] == [404, 405, 400, 415, 422, 413, 422, 404]
    for a in answers:
        body = a.json()
        assert list(body) == ["detail"] and isinstance(body["detail"], str), body
    unloaded = TestClient(create_app(settings, loader=lambda s: None))
    assert unloaded.get("/health").json() == {"detail": "the model and index are not loaded yet"}
