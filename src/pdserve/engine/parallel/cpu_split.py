"""Each rank of a tensor-parallel engine computes on its own cores."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def split_cpus(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """`cpus` in n contiguous shares of sizes differing by at most one; with fewer cores than
    shares, share r is the single core cpus[r % len(cpus)] (ranks then share cores)."""
    cpus = sorted(cpus)
    if len(cpus) < n:
        return [(cpus[r % len(cpus)],) for r in range(n)]
    return [tuple(cpus[r * len(cpus) // n : (r + 1) * len(cpus) // n]) for r in range(n)]


def pin(cpus: Sequence[int]) -> tuple[set[int], int]:
    """Run the calling thread (and the threads it starts later) on `cpus`, with that many
    compute threads; returns the previous (affinity, threads) for `unpin`."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(len(cpus))
    return before


def unpin(before: tuple[set[int], int]) -> None:
    os.sched_setaffinity(0, before[0])
    torch.set_num_threads(before[1])
