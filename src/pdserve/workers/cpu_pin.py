"""A worker's cores, changed while it serves (`POST /internal/cpus`, signed).

Why: where workers split one machine's cores, a worker may lend an idle peer's cores to a busy
one and hand them back later, without a restart (a worker on one core of two prefills a long
prompt at half the speed of both; on some machines its decode steps cost over twice as much
per stream). This is the worker's half: it computes on the cores it is told to, from its next
step on. Which worker gets which cores is the caller's to decide.

Applied on the engine thread, between two steps (`EngineLoop` takes commands only there):
every thread of the process is pinned to the new set (the engine thread first: a set the
kernel refuses fails there, with nothing changed; then its compute pool's threads, the HTTP
and transfer threads), then the engine thread's compute threads are set to the set's size.
`torch.set_num_threads` must run on the engine thread: PyTorch's OpenMP regions take the
calling thread's count, and every pdserve kernel splits its work by `at::parallel_for`, which
reads it per call. So a step never runs with threads on the old set and the count of the new.

Refused: a tensor-parallel engine (its ranks are processes of their own, each pinned to its
share by `cpu_split.py`; 409); an empty or bad list, or a core the machine lacks (400).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.api.errors import ApiError, bad_request
from pdserve.engine.parallel.cpu_split import pin_threads

BOOT_ID = "/proc/sys/kernel/random/boot_id"  # changes at every boot of the kernel


@dataclass(frozen=True)
class PinDone:
    """The worker computes on `cpus` with `threads` compute threads, where it had
    `threads_before`; `seconds` to apply it."""

    cpus: tuple[int, ...]
    threads: int
    seconds: float
    threads_before: int = 0

    def body(self) -> dict[str, Any]:
        return {"cpus": list(self.cpus), "threads": self.threads, "seconds": self.seconds}


def parse_cpus(body: Any) -> tuple[int, ...]:
    """The sorted cores of a `{"cpus": [...]}` body; ApiError (400) naming what is wrong."""
    if not isinstance(body, dict) or set(body) != {"cpus"}:
        raise bad_request('the body must be a JSON object like {"cpus": [0, 1]}, with no '
                          "other key")
    cpus = body["cpus"]
    count = os.cpu_count() or 1
    if not isinstance(cpus, list) or not cpus or any(
            type(c) is not int or not 0 <= c < count for c in cpus):
        raise bad_request(f"cpus must be a non-empty list of core numbers from 0 to "
                          f"{count - 1}; got {cpus!r}", "cpus")
    if len(set(cpus)) != len(cpus):
        raise bad_request(f"cpus lists a core twice: {cpus!r}", "cpus")
    return tuple(sorted(cpus))


def pin_process(cpus: Iterable[int], tensor_parallel_size: int) -> PinDone | ApiError:
    """Pin every thread of this process to `cpus` and set the compute threads to their count.
    Call on the engine thread."""
    t0, cpus, before = time.perf_counter(), tuple(cpus), torch.get_num_threads()
    if tensor_parallel_size > 1:
        return ApiError(409, f"a tensor-parallel engine ({tensor_parallel_size} ranks) keeps "
                             "the cores each rank was started on", param="cpus",
                        code="tensor_parallel")
    try:
        pin_threads(cpus)
    except OSError as e:
        return ApiError(400, f"the kernel refused cores {list(cpus)}: {e}", param="cpus")
    torch.set_num_threads(len(cpus))
    return PinDone(cpus, torch.get_num_threads(), time.perf_counter() - t0, before)


def current_cpus() -> list[int]:
    """The cores the calling thread may run on (every thread's, after `pin_process`)."""
    return sorted(os.sched_getaffinity(0))


def host_id() -> str:
    """Which machine (and boot of it) the worker runs on: its host name and the kernel's boot
    id. Core numbers mean the same cores only between workers with the same host id, so cores
    are lent only between them."""
    try:
        boot = Path(BOOT_ID).read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
