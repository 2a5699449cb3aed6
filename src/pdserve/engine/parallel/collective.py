"""The sum over ranks that follows every row-parallel linear, through a process group (CUDA,
and CPUs where `shm_all_reduce.py` does not apply).

One process group per engine, made directly (not torch.distributed's global default group),
so that one process may hold several tensor-parallel engines, one after another or at once.
gloo on CPU, NCCL on CUDA (the NCCL path is not exercised by the tests here). Rendezvous is a
TCPStore that rank 0 opens on a free port of 127.0.0.1 before it starts the other ranks.

A collective waits at most `timeout` for a rank that neither answers nor exits (a rank that
exits closes its sockets, and the others' collectives fail at once).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=60)


def open_store(size: int) -> dist.TCPStore:
    """Rank 0's store, on a free port (`store.port`); the others `join_store` it."""
    return dist.TCPStore(STORE_HOST, 0, size, True, timeout=TIMEOUT, wait_for_workers=False)


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, size, False, timeout=TIMEOUT)


class Collective:
    """All-reduce (sum) among the `size` ranks of one engine. Constructing it is the
    rendezvous: every rank constructs one, and each waits for all the others."""

    def __init__(self, store: dist.TCPStore, rank: int, size: int, device: torch.device) -> None:
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` (contiguous) over the ranks, in place; every rank gets the same bits."""
        self.group.allreduce([t]).wait()
        return t
