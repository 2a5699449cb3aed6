"""The router's back-pressure options: how many legs a worker is given at once, how long a
request may wait at the router for one, and how many may wait. One frozen
`AdmissionSettings` per router, set with `add_admission_args` / `admission_from_args`
(`admission_to_args` writes them back, for `pdserve up`).

Invariants: a fixed queue size is >= 0 places, the longest wait > 0 seconds, a fixed in-flight
cap >= 1 request; `None` means "from measurement" (`capacity.py`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pdserve.cli_args import add_admission_flags

# Long enough that a burst of a few times a CPU cluster's slots drains inside it (a request of
# a few hundred tokens takes seconds there); short enough that an overloaded cluster answers
# within half a minute, where without admission its P99 reached 68-98 s (64 streams, 2 cores).
DEFAULT_MAX_QUEUE_WAIT_S = 30.0


@dataclass(frozen=True)
class AdmissionSettings:
    max_queue: int | None = None  # places in each pool's queue; None: measured (capacity.py)
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S  # longest wait for a slot, then 503
    max_inflight_per_worker: int | None = None  # None: the worker's KV and batch limits

    def __post_init__(self) -> None:
        if self.max_queue is not None and not _is_int(self.max_queue, 0):
            raise ValueError(f"--max-queue must be an integer >= 0 (0: no waiting, refuse at "
                             f"once when every worker is at its cap), got {self.max_queue!r}")
        wait = self.max_queue_wait_s
        if not (isinstance(wait, int | float) and wait > 0 and math.isfinite(wait)):
            raise ValueError(f"--max-queue-wait-s must be a number of seconds > 0, got {wait!r}")
        if self.max_inflight_per_worker is not None and \
                not _is_int(self.max_inflight_per_worker, 1):
            raise ValueError(f"--max-inflight-per-worker must be an integer >= 1, got "
                             f"{self.max_inflight_per_worker!r}")


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """The router's admission flags (cli_args.add_admission_flags: `pdserve simulate` declares
    the same ones)."""
    add_admission_flags(
        p, title="admission (back-pressure at the router)", wait_s=DEFAULT_MAX_QUEUE_WAIT_S,
        inflight_default="what the worker can hold: its batch limit, and, once requests were "
                         "measured, the number of average requests whose KV fits its pool",
        queue_default="the measured completions per second times --max-queue-wait-s, "
                      "Little's law",
        wait_default="%(default)s", refusal=" and Retry-After")


def admission_from_args(args: argparse.Namespace) -> AdmissionSettings:
    """ValueError for a bad value, naming the flag."""
    return AdmissionSettings(max_queue=args.max_queue, max_queue_wait_s=args.max_queue_wait_s,
                             max_inflight_per_worker=args.max_inflight_per_worker)


def admission_to_args(settings: AdmissionSettings) -> list[str]:
    """The router flags that give `settings` back through `admission_from_args` (none for a
    default)."""
    argv = [] if settings.max_queue_wait_s == DEFAULT_MAX_QUEUE_WAIT_S else \
        ["--max-queue-wait-s", repr(settings.max_queue_wait_s)]
    if settings.max_queue is not None:
        argv += ["--max-queue", str(settings.max_queue)]
    if settings.max_inflight_per_worker is not None:
        argv += ["--max-inflight-per-worker", str(settings.max_inflight_per_worker)]
    return argv
