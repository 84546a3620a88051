"""CPU threads of torch and FAISS, bounded together: the machines are shared and a worker
that takes every core slows its neighbours (the index commands and the service use it)."""

from __future__ import annotations

import faiss
import torch

__all__ = ["set_threads"]


def set_threads(n: int) -> None:
    """Use at most ``n`` (>= 1) CPU threads in torch and in FAISS's OpenMP loops."""
    torch.set_num_threads(max(1, n))
    faiss.omp_set_num_threads(max(1, n))
