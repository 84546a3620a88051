"""The edge under hostile but legal clients, over real HTTP on 127.0.0.1: body limits refused
before the body is sent, header and body deadlines, slow uploads that cost no admission slot,
uploads per client address and open connections capped, multipart parts counted as they
arrive, the admission cap (503 + Retry-After), /health under load, log lines that cannot be
forged and that name the client and key id, and one error shape."""

import asyncio
import hashlib
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
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {length}\r\n"
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
        # no blank line after the headers
        reply, seconds = exchange(url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        assert reply == b"" and 0.4 < seconds < 3  # header_timeout=0.5
        reply, seconds = exchange(url, upload_head("/retrieve", 1000) + b"--xyz\r\n")
        assert status_of(reply) == 408, reply
        assert b"request body too slow: 7 bytes in 0.5s; a body must arrive within 0.5s + 1s" \
            in reply, reply
        assert seconds < 3
        assert httpx.get(f"{url}/health").status_code == 200


def fake_engine(fake_index, delay: float = 0.0, gate: threading.Event | None = None):
    """The fake-embedder engine; each retrieval waits for `gate` and sleeps `delay`."""
    from index.store import load_index
    from service.retrieval import RetrievalEngine

    index_dir, embedder = fake_index
    engine = RetrievalEngine(embedder, load_index(index_dir, embedder.sha256),
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
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
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

    # Its own process, as deployed: the load client does not hold the server's GIL. One
    # address sends them all: the cap per client address is opened as far as the admission.
    with service_process(real_index, "--max-pending", str(n), "--max-uploads-per-client",
                         str(n)) as (url, _):
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
    assert line.startswith("testclient key=- GET /photos/x\\x0a127.0.0.1 GET /admin 200 1.0ms"
                           "\\x00\\x1b[31m 404 ")


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


# --- slow uploads, uploads per client, open connections -------------------------------------

BOUNDARY = "trickle"


async def trickle(url: str, source: str, length: int, every: float) -> tuple[int, float]:
    """A /retrieve upload from loopback address `source` that declares `length` bytes and
    sends one every `every` seconds (the first after `every` / 2, so that none crosses the
    server's answer at a deadline in whole seconds); (its status, seconds until answered)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    writer.write((f"POST /retrieve HTTP/1.1\r\nHost: {host}:{port}\r\n"
                  f"Content-Length: {length}\r\nContent-Type: multipart/form-data; "
                  f"boundary={BOUNDARY}\r\n\r\n").encode())
    body = f"--{BOUNDARY}\r\n".encode()
    try:
        for i in range(length):
            try:
                status_line = await asyncio.wait_for(reader.readline(),
                                                     every / 2 if i == 0 else every)
            except TimeoutError:
                writer.write(body[i % len(body):][:1])
                await writer.drain()
                continue
            return int(status_line.split()[1]), time.monotonic() - start
        raise AssertionError("the whole body went out")
    finally:
        writer.close()


async def retrievals(url: str, n: int, png: bytes, source: str = "127.0.0.1") -> list[int]:
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(base_url=url, timeout=30, transport=transport) as http:
        answers = await asyncio.gather(*[http.post(
            "/retrieve", files={"file": ("s.png", png, "image/png")}) for _ in range(n)])
    return [a.status_code for a in answers]


def test_slow_uploads_cost_no_admission_slot(fake_index, fake_settings):
    """40 uploads that declare a 5 MB body and send a byte every 2 s, from 5 loopback
    addresses (8 each, under the per-client cap), beside 20 ordinary retrievals: every
    retrieval is answered 200 at once, and every slow upload 408 once it falls behind."""
    settings = fake_settings
    assert settings.max_pending < 40 and settings.max_uploads_per_client >= 20
    png = sketch_png()

    async def scene(url):
        slow = [asyncio.create_task(trickle(url, f"127.0.0.{2 + i % 5}", 5_000_000, 2.0))
                for i in range(40)]
        await asyncio.sleep(1.5)  # every slow upload is in, with a byte or two of its body
        t0 = time.monotonic()
        codes = await retrievals(url, 20, png)
        seconds = time.monotonic() - t0
        still_open = sum(not t.done() for t in slow)
        return codes, seconds, still_open, await asyncio.gather(*slow)

    with serve(create_app(settings, loader=lambda s: fake_engine(fake_index)), settings) as url:
        codes, seconds, still_open, slow = asyncio.run(scene(url))
    print(f"20 retrievals beside 40 slow uploads: {seconds:.2f} s; slow uploads answered "
          f"{sorted({c for c, _ in slow})} after {min(s for _, s in slow):.1f}-"
          f"{max(s for _, s in slow):.1f} s")
    assert codes == [200] * 20
    assert seconds < 10  # measured: well under 1 s
    assert still_open == 40  # they were all trickling while the retrievals ran
    # Each falls behind once body_timeout is spent (a byte per 2 s is under any pace).
    assert [c for c, _ in slow] == [408] * 40
    assert all(settings.body_timeout <= s < settings.body_timeout + 5 for _, s in slow)


@pytest.fixture
def fake_settings(fake_index):
    """The defaults, on the fake index: the limits as a deployment meets them."""
    return Settings(index=fake_index[0])


def test_uploads_per_client_address_are_capped(fake_index):
    settings = Settings(index=fake_index[0], max_uploads_per_client=2, body_timeout=1.5,
                        body_min_rate=1024)
    png = sketch_png()

    async def scene(url):
        slow = [asyncio.create_task(trickle(url, "127.0.0.2", 100_000, 0.3)) for _ in range(2)]
        await asyncio.sleep(0.5)
        third = await trickle(url, "127.0.0.2", 100_000, 0.3)  # answered before its body
        beside = await retrievals(url, 2, png, source="127.0.0.3")  # another address
        first_two = await asyncio.gather(*slow)
        after = await retrievals(url, 2, png, source="127.0.0.2")  # their slots are free
        return third, beside, first_two, after

    app = create_app(settings, loader=lambda s: fake_engine(fake_index))
    with serve(app, settings) as url:
        (third, seconds), beside, first_two, after = asyncio.run(scene(url))
    assert third == 429 and seconds < 1
    assert beside == [200, 200] and after == [200, 200]
    assert [c for c, _ in first_two] == [408, 408]
    assert app.state.uploads.by_client == {}  # every count given back
    scrape = app.state.metrics.render().decode()
    assert "sketchsvd_uploads_refused_total 1.0" in scrape and "sketchsvd_uploads 0.0" in scrape


def test_open_connections_are_capped(fake_index):
    settings = Settings(index=fake_index[0], max_connections=4)
    with serve(create_app(settings, loader=lambda s: fake_engine(fake_index)), settings) as url:
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(4)]
        try:
            time.sleep(0.3)
            assert httpx.get(f"{url}/health").status_code == 503
        finally:
            for s in idle:
                s.close()
        time.sleep(0.3)
        assert httpx.get(f"{url}/health").status_code == 200


# --- multipart parts, counted as they arrive ------------------------------------------------

def multipart(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """(body, content type) of (field, filename or None, data) parts, multipart encoded."""
    boundary = "b0undary-7f3a"
    out = []
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename is not None else "")
        out.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
                   + data + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


def test_parts_are_counted_as_the_body_streams_in():
    from service.middleware import PartCounter

    body, ctype = multipart([("files", f"{i}.png", b"--x\r\n--" * i) for i in range(4)]
                            + [("note", None, b"a field")])
    boundary = ctype.split("boundary=")[1].encode()
    cuts = [[body]] + [[body[:i], body[i:]] for i in range(len(body))] + [
        [body[i:i + 1] for i in range(len(body))]]
    for chunks in cuts:  # every split point, and a byte at a time
        counter = PartCounter(boundary, limit=5)
        assert all(counter.feed(c) for c in chunks) and counter.parts == 5
    counter = PartCounter(boundary, limit=4)
    assert not counter.feed(body) and counter.parts == 5


def test_a_batch_of_1000_parts_is_refused_before_the_parser_reads_them(client, settings,
                                                                      monkeypatch):
    from starlette.formparsers import MultiPartParser

    begun = []
    part_begin = MultiPartParser.on_part_begin
    monkeypatch.setattr(MultiPartParser, "on_part_begin",
                        lambda self: (begun.append(1), part_begin(self)))
    limit = settings.max_batch + 8  # the batch's files, and FORM_FIELDS other parts
    for parts in ([("files", f"{i}.png", b"x") for i in range(1000)],
                  [("field", None, b"x") for i in range(1000)]):
        body, ctype = multipart(parts)
        begun.clear()
        r = client.post("/retrieve/batch", content=body, headers={"Content-Type": ctype})
        assert r.status_code == 413, r.text
        assert r.json() == {"detail": f"multipart body of more than {limit} parts"}
        assert len(begun) <= limit  # Starlette began no part past the limit
    files = [("files", (f"q{i}.png", sketch_png(seed=i), "image/png")) for i in range(5)]
    r = client.post("/retrieve/batch", files=files)  # within the parts: the route says why
    assert r.status_code == 413 and "5 files is over the batch limit of 4" in r.json()["detail"]


# --- the access log --------------------------------------------------------------------------

def test_the_access_log_names_the_client_and_key_id_and_cuts_signatures(settings, engine,
                                                                        caplog):
    from service.auth import key_id

    key = "k3y-0123456789abcdef0123456789abcdef"
    app = create_app(settings.model_copy(update={"api_keys": [key]}), loader=lambda s: engine)
    with TestClient(app) as http, caplog.at_level(logging.INFO, logger="service.access"):
        hit = http.post("/retrieve", files={"file": ("s.png", sketch_png())},
                        headers={"X-API-Key": key}).json()["results"][0]
        http.get(hit["url"])
        http.get("/info", headers={"X-API-Key": "wrong"})
        http.get("/info")
    lines = [r.getMessage() for r in caplog.records if r.name == "service.access"]
    photo, query = hit["url"].split("?")
    expires = query.split("&")[0]
    assert [line.rsplit(" ", 1)[0] for line in lines] == [
        f"testclient key={key_id(key)} POST /retrieve 200",
        f"testclient key=signed GET {photo}?{expires}&sig=- 200",
        "testclient key=invalid GET /info 401",
        "testclient key=- GET /info 401",
    ]
    assert not any(key in line or query.split("sig=")[1] in line for line in lines)
    assert key_id(key) == hashlib.sha256(key.encode()).hexdigest()[:8]


def test_the_access_log_names_the_client_address_over_http(fake_index, edge_settings, caplog):
    app = create_app(edge_settings, loader=lambda s: fake_engine(fake_index))
    # The level first: the server thread logs after the answer, and stops before it is reset
    with caplog.at_level(logging.INFO, logger="service.access"), serve(app, edge_settings) as url:
        transport = httpx.HTTPTransport(local_address="127.0.0.7")
        with httpx.Client(base_url=url, transport=transport) as http:
            assert http.get("/health").status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if r.name == "service.access"]
    assert line.startswith("127.0.0.7 key=- GET /health 200 ")
