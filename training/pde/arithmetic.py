"""What arithmetic a training step uses when left to choose (``--stencil-precision auto``,
``--fused-update auto``, the defaults), and why; metrics.json and the log record both.

- The bf16 stencil (``networks.DisjointMLPs.fd_stencil``) rounds the first layer's
  Fourier-feature products to bfloat16. It pays where bf16 products run faster than fp32
  ones: on CPUs with AVX512-BF16 or AMX (the paper architecture's step ~1.8-2x faster on
  such a CPU, benchmarks/pde_bench.py), and on CUDA at large batches only (an H200: slower
  at batch 128 and 512, where the step is launch-bound; 11.0 -> 6.9 ms at 4096). Its
  accuracy matches fp32 within the seed spread (docs/operators.md).
- The fused update (``training.pde.update``) runs RMSprop and the EMA in one compiled pass
  per tensor, the same update to float rounding; it needs torch.compile (a C++ compiler)
  and is for the CPU.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["STENCIL_SETTINGS", "FUSED_UPDATES", "CUDA_BF16_MIN_BATCH", "cpu_bf16_units",
           "choose_stencil_precision", "choose_fused_update"]

log = logging.getLogger(__name__)

STENCIL_SETTINGS = ("auto", "fp32", "bf16")
FUSED_UPDATES = ("auto", "true", "false")
CUDA_BF16_MIN_BATCH = 4096  # measured faster at 4096, slower at 128 and 512 (H200)


def cpu_bf16_units() -> list[str]:
    """The CPU's bf16 matrix units that torch reports: "AVX512-BF16", "AMX" (or none)."""
    probes = {"AVX512-BF16": "_is_avx512_bf16_supported", "AMX": "_is_amx_tile_supported"}
    found = []
    for name, probe in probes.items():
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                found.append(name)
        except RuntimeError:  # a build without the probe's backend
            continue
    return found


def choose_stencil_precision(setting: str, device: torch.device, batch_size: int,
                             laplacian: str) -> tuple[str, str]:
    """(precision, why) of the stencil's first-layer products for a batch size."""
    if setting not in STENCIL_SETTINGS:
        raise ValueError(f"stencil_precision must be one of {STENCIL_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return setting, f"--stencil-precision {setting}"
    if laplacian != "fd":
        return "fp32", f"the {laplacian} Laplacian has no bf16 path"
    if device.type == "cuda":
        if batch_size >= CUDA_BF16_MIN_BATCH:
            return "bf16", f"CUDA at batch {batch_size} >= {CUDA_BF16_MIN_BATCH}"
        return "fp32", f"CUDA at batch {batch_size} < {CUDA_BF16_MIN_BATCH} (launch-bound)"
    if device.type == "cpu":
        units = cpu_bf16_units()
        if units:
            return "bf16", f"this CPU has {' and '.join(units)}"
        return "fp32", "this CPU has neither AVX512-BF16 nor AMX"
    return "fp32", f"no bf16 measurement on {device.type}"


def choose_fused_update(setting: str, device: torch.device) -> tuple[bool, str]:
    """(use the fused update, why); "auto" still falls back to torch's update where
    torch.compile fails (``training.pde.train``)."""
    if setting not in FUSED_UPDATES:
        raise ValueError(f"fused_update must be one of {FUSED_UPDATES}, got {setting!r}")
    if setting == "false":
        return False, "--fused-update false"
    if device.type != "cpu":
        if setting == "true":
            log.warning("--fused-update is for the CPU; %s uses torch's RMSprop and EMA", device)
        return False, f"the fused update is compiled for the CPU, not {device.type}"
    return True, "--fused-update true" if setting == "true" else "a CPU"
