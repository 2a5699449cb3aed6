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
    g = p.add_argument_group("admission (back-pressure at the router)")
    g.add_argument("--max-inflight-per-worker", type=int, default=None, metavar="N",
                   help="requests a worker is given at once; more wait in the router's queue "
                        "(default: what the worker can hold: its batch limit, and, once "
                        "requests were measured, the number of average requests whose KV fits "
                        "its pool)")
    g.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests that may wait for a worker, per pool (prefill; decode and "
                        "collocated); one more gets 429 with Retry-After (default: the measured "
                        "completions per second times --max-queue-wait-s, Little's law)")
    g.add_argument("--max-queue-wait-s", type=float, default=DEFAULT_MAX_QUEUE_WAIT_S,
                   metavar="SECONDS",
                   help="longest a request waits for a worker before it gets 503 with "
                        "Retry-After (default: %(default)s)")


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
