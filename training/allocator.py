"""The C allocator tuned for tensor work, called by every entry point.

With glibc's defaults every tensor above the dynamic mmap threshold (at most 32 MB) gets
pages of its own that are returned on free, so a network's forward pass page-faults its
activations in anew on every call: measured here (``research/allocator_bench.py``, one
thread), an EfficientNet-Lite0 forward of 64 images took 6.1 s with 2.0 million minor faults
and 4.3 s in the kernel, and 1.6 s with 10 thousand faults after ``tune_allocator()``.
Freed memory then stays in the process for reuse instead; the peak is unchanged.
``SKETCHSVD_ALLOCATOR=default`` in the environment keeps glibc's defaults (to compare, or to
hand memory back sooner).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["tune_allocator"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap and are reused
_TRIM_THRESHOLD = (1 << 31) - 1  # keep up to 2 GiB of free heap rather than unmap it


def tune_allocator() -> bool:
    """Keep freed blocks below 1 GiB for reuse (glibc only; elsewhere a no-op). Returns
    whether the settings took effect. Forked DataLoader workers inherit them."""
    if os.environ.get("SKETCHSVD_ALLOCATOR", "") == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the allocator settings")
    return ok
