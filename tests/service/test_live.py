"""The service over real HTTP: uvicorn on 127.0.0.1, a real model bundle, `python -m service`."""

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from service.__main__ import main as service_main
from tests.conftest import REPO
from tests.service.conftest import free_port


def test_real_server_answers_over_http(live_server, small_sketches):
    with httpx.Client(base_url=live_server, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        info = http.get("/info").json()
        assert (info["width"], info["backbone"], info["gallery_size"]) == (
            8, "efficientnet-lite0", 15)
        assert info["encoder"] == "onnxruntime"  # the CPU default
        r = http.post("/retrieve", params={"dims": 4, "k": 5},
                      files={"file": ("q.png", small_sketches[0], "image/png")})
        assert r.status_code == 200
        body = r.json()
        assert (body["dims"], body["k"], len(body["results"])) == (4, 5, 5)
        scores = [h["score"] for h in body["results"]]
        assert scores == sorted(scores, reverse=True)
        photo = http.get(body["results"][0]["url"])
        assert photo.status_code == 200 and photo.headers["content-type"] == "image/jpeg"
        assert http.post("/retrieve", files={"file": ("x.png", b"junk", "image/png")}
                         ).status_code == 415
        assert http.get("/health").status_code == 200


def test_raw_dot_dot_path_is_not_served(live_server):
    # Sent verbatim (HTTP clients normalise "..", attackers do not).
    host, port = live_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /photos/../../../../etc/passwd HTTP/1.1\r\nHost: localhost\r\n"
                  b"Connection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status = reply.split(b"\r\n", 1)[0]
    assert b" 404 " in status and b"root:" not in reply


def test_missing_index_prints_the_build_command(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert service_main(["--index", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"no index folder at '{missing}'" in err
    assert ("python -m training.cdk --data DATA --split none --out runs/cdk && python -m "
            f"index.build --model runs/cdk/model --photos PHOTOS --out {missing}") in err


def test_python_m_service_starts_and_serves(real_index, small_sketches):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SKETCHSVD_MAX_K": "7"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--index", str(real_index), "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"service exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("service did not become healthy in 90 s")
            time.sleep(0.3)
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{base}/retrieve", params={"k": 7},
                       files={"file": ("q.png", small_sketches[1], "image/png")}, timeout=30)
        assert r.status_code == 200 and len(r.json()["results"]) == 7
        assert httpx.post(f"{base}/retrieve", params={"k": 8},
                          files={"file": ("q.png", small_sketches[1], "image/png")},
                          timeout=30).status_code == 422  # SKETCHSVD_MAX_K applied
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert f"serving on http://127.0.0.1:{port}/" in out
    assert "POST /retrieve?k=7 200" in out  # access log with latency


def test_benchmark_load_runs_without_errors(live_server, small_sketches):
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("service_bench",
                                                  REPO / "benchmarks" / "service_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    single = asyncio.run(bench.load(live_server, small_sketches, 4, 8, dims=8, k=5))
    assert single["errors"] == [] and len(single["latencies"]) == 8
    assert set(single["timings"][0]) == set(bench.STAGES)
    batched = asyncio.run(bench.load(live_server, small_sketches, 1, 2, dims=4, k=3, batch=3))
    assert batched["errors"] == [] and len(batched["latencies"]) == 2
