"""The one way benchmarks here time things: one warm-up call, then the median of repeats (the
fastest of them for a machine's ceiling)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of `repeats` calls of fn, after one untimed warm-up call (kernel selection,
    allocator, page faults, connection set-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of fn, after a warm-up."""
    return statistics.median(_timed(fn, repeats))


def fastest_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` calls of fn after a warm-up: what the machine can do (a roof),
    which a neighbour's load on a shared machine only ever hides (STREAM reports its best
    run for the same reason)."""
    return min(_timed(fn, repeats))


def synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """fn, then a wait for the GPU's queued work when `device` is one (what a timing of work
    queued on a GPU must include); fn itself on the CPU."""
    if device == "cpu":
        return fn

    def run() -> None:
        import torch  # a GPU timing only: this module stays torch-free

        fn()
        torch.cuda.synchronize(device)

    return run
