"""Memory under concurrent maximum-size uploads, measured on a real `python -m service`
process (peak RSS from /proc, exact). benchmarks/memory_bench.py runs the full-size case."""

import sys

import pytest

from benchmarks.memory_bench import MB, big_sketch_png, measure
from tests.service.conftest import service_process


@pytest.mark.skipif(sys.platform != "linux", reason="reads VmHWM from /proc")
def test_concurrent_maximal_batches_stay_within_a_memory_bound(real_index):
    png = big_sketch_png(4095)  # legal: 4095 x 4095 <= MAX_PIXELS, ~0.2 MB < 5 MiB
    with service_process(real_index) as (url, proc):
        res = measure(url, proc.pid, png, batches=2, files=4)
    print(f"peak RSS growth: one batch of 4 +{res['one'] / MB:.0f} MB, "
          f"2 at once +{res['burst'] / MB:.0f} MB")
    assert res["statuses"] == [200, 200, 200]
    # Decoded one at a time in 2 slots and shrunk while decoding: one full-size RGBA decode
    # (64 MiB) per slot. Before: every image of every request decoded and converted at full
    # size at once (+1.5 GB for one batch of 16 in the benchmark).
    assert res["one"] < 250 * MB and res["burst"] < 400 * MB, res
