"""Graceful shutdown of a real `python -m service` process: SIGTERM under load answers every
admitted request, cuts none, refuses new ones with 503 and exits 0 within the timeout."""

import asyncio
import re
import signal
import threading
import time

import httpx

from service.client import AsyncClient, ServiceError
from tests.service.conftest import service_process


def test_sigterm_under_load_answers_every_admitted_request_and_exits_0(real_index,
                                                                      small_sketches):
    outcomes: list[str] = []  # per request: 200, 503, refused (never connected) or an error
    stop = threading.Event()

    async def client(service, i: int):
        while not stop.is_set():
            try:
                result = await service.retrieve(small_sketches[i % len(small_sketches)], k=5)
                outcomes.append("200" if len(result.hits) == 5 else "short")
            except ServiceError as err:
                outcomes.append(str(err.status))
                if err.status == 503:
                    return  # shutting down: this client is done
            except httpx.ConnectError:
                outcomes.append("refused")
                return
            except Exception as err:  # noqa: BLE001 - a cut request is the test's finding
                outcomes.append(repr(err))
                return

    async def load(url):
        async with AsyncClient(url, connections=16, timeout=120) as service:
            await asyncio.gather(*(client(service, i) for i in range(16)))

    timeout = 30
    # PyTorch encodes (no ONNX export at start): what is tested is the server around it.
    with service_process(real_index, "--log-level", "info", "--shutdown-timeout",
                         str(timeout), "--encoder", "torch") as (url, proc):
        loader = threading.Thread(target=lambda: asyncio.run(load(url)))
        loader.start()
        deadline = time.monotonic() + 120
        while outcomes.count("200") < 16 and time.monotonic() < deadline:
            time.sleep(0.05)  # under load: 16 in flight, most waiting for a slot
        served_before = outcomes.count("200")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=timeout + 30)
        took = time.monotonic() - sent
        stop.set()
        loader.join(timeout=60)
        log = proc.output()
    print(f"exit {code} {took:.1f} s after SIGTERM; outcomes: "
          + ", ".join(f"{o} x{outcomes.count(o)}" for o in sorted(set(outcomes))))
    assert code == 0 and took < timeout
    assert set(outcomes) <= {"200", "503", "refused"}, outcomes  # no request cut
    assert outcomes.count("200") > served_before  # requests admitted before SIGTERM finished
    answered = re.findall(r"POST /retrieve\?k=5 (\d+) ", log)
    assert answered.count("200") == outcomes.count("200")  # every admitted one reached its client
    assert "500" not in answered and "shutting down" in log
