"""Multi-process training under torchrun: joining and leaving the process group, running
a step on rank 0 before the others, and the all-gather of per-rank rows that the
full-batch estimator needs. Every function also works in a single plain process."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = ["init_from_env", "rank_and_world", "barrier", "shutdown", "main_first",
           "rank0_says", "gather_rows"]

T = TypeVar("T")


def init_from_env() -> torch.device | None:
    """Join the torchrun process group when launched with WORLD_SIZE > 1 (NCCL on this
    process's GPU, else gloo on the CPU) and return its device; None in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return None
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, number of processes); (0, 1) without a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Wait for every rank, then leave the process group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main_first(step: Callable[[], T]) -> T:
    """Run ``step`` on rank 0, then on the other ranks: rank 0 fills a shared cache that
    the others then only read."""
    rank, _ = rank_and_world()
    if rank == 0:
        out = step()
    barrier()
    if rank != 0:
        out = step()
    barrier()
    return out


def rank0_says(flag: bool, device: torch.device) -> bool:
    """Rank 0's ``flag`` on every rank (``flag`` itself in a single process): a decision
    each rank computes from its own clock must be one decision, or the ranks deadlock."""
    if not dist.is_initialized():
        return flag
    out = torch.tensor(float(flag), device=device)
    dist.broadcast(out, 0)
    return bool(out.item())


def gather_rows(x: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """All ranks' (b, L) blocks -> (W*b, L); only the local block carries gradient."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.detach().contiguous())
    parts[rank] = x
    return torch.cat(parts)
