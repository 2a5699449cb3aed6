"""Each rank of a tensor-parallel engine computes on its own cores."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

import torch


def split_cpus(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """`cpus` in n contiguous shares of sizes differing by at most one; with fewer cores than
    shares, share r is the single core cpus[r % len(cpus)] (ranks then share cores)."""
    cpus = sorted(cpus)
    if len(cpus) < n:
        return [(cpus[r % len(cpus)],) for r in range(n)]
    return [tuple(cpus[r * len(cpus) // n : (r + 1) * len(cpus) // n]) for r in range(n)]


def pin_rank(cpus: Sequence[int]) -> None:
    """A process of its own (a rank's) computes on `cpus`: every thread, with that many
    compute threads."""
    pin_threads(tuple(cpus))
    torch.set_num_threads(len(cpus))


def pin_threads(cpus: tuple[int, ...]) -> None:
    """Every thread of this process on `cpus`, the calling one first: OSError when the kernel
    refuses the set, and then nothing changed. Threads started at import, before a worker
    pins itself at start, are moved too (a pin of the calling thread alone leaves them on
    every core)."""
    os.sched_setaffinity(0, cpus)
    own = threading.get_native_id()
    for tid in _threads():
        if tid != own:  # OSError: it ended meanwhile (the set itself was accepted above)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


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
