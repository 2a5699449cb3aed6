"""Per-worker circuit breakers: a worker whose legs keep failing gets no new requests for a
cool-down, then one probe, instead of a request every health round.

States (one `Breaker` per worker, `Breakers` holds them; the event loop's only):
- CLOSED: routable. `failures_to_open` leg failures in a row (no success between) open it.
- OPEN: not routable until `cooldown` has passed since it opened. Failures of legs that
  started before it opened change nothing.
- HALF_OPEN: the cool-down passed. Routable while no probe is in flight; the first leg that
  starts there is the probe. Its success closes the breaker (the cool-down back to
  `cooldown_s`); its failure opens it again for twice the last cool-down, at most
  `max_cooldown_s`. A probe that ends with neither (the client went away) lets the next leg
  probe.

A failure is what the router judged the worker's fault (`WorkerPool.mark_failed`: a leg lost,
timed out or ended with the worker's error); a success is a leg that ended with its final
event. A client's error is neither. Breakers sit on top of health: a worker is routable when
its health checks pass and its breaker lets it (`dispatch.py`). Requests granted a half-open
worker in the same instant may all reach it; one is counted as the probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle


@dataclass(frozen=True)
class BreakerSettings:
    failures_to_open: int = 3  # leg failures in a row that open a worker's breaker
    cooldown_s: float = 1.0  # the first cool-down; doubled after each failed probe
    max_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if type(self.failures_to_open) is not int or self.failures_to_open < 1:
            raise ValueError(f"failures_to_open must be an int >= 1, got "
                             f"{self.failures_to_open!r}")
        if not self.cooldown_s > 0:
            raise ValueError(f"cooldown_s must be > 0 seconds, got {self.cooldown_s!r}")
        if not self.max_cooldown_s >= self.cooldown_s:
            raise ValueError(f"max_cooldown_s ({self.max_cooldown_s}) must be at least "
                             f"cooldown_s ({self.cooldown_s})")


class BreakerState(IntEnum):
    """The values of the breaker state gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Breaker:
    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self.failures = 0  # in a row, while closed
        self.opened_at: float | None = None  # None: closed
        self.cooldown = settings.cooldown_s
        self.probing = False  # half-open: the probe is in flight

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if now < self.opened_at + self.cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows(self, now: float) -> bool:
        state = self.state(now)
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and
                                                not self.probing)

    def started(self, now: float) -> bool:
        """A leg starts on the worker; True if it is the half-open worker's probe."""
        if self.state(now) is BreakerState.HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def ended(self, succeeded: bool, probe: bool) -> None:
        """A leg ended; `succeeded`: with its final event. Its failure came in `failed`."""
        if probe and self.probing:
            self.probing = False
            if succeeded:
                self.opened_at, self.cooldown = None, self.settings.cooldown_s
        if succeeded and self.opened_at is None:
            self.failures = 0

    def failed(self, now: float) -> None:
        state = self.state(now)
        if state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures >= self.settings.failures_to_open:
                self.failures, self.opened_at = 0, now
        elif state is BreakerState.HALF_OPEN and self.probing:
            self.probing, self.opened_at = False, now
            self.cooldown = min(2 * self.cooldown, self.settings.max_cooldown_s)


class Breakers:
    """One breaker per worker, made on first use."""

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.settings, self.clock = settings, clock
        self._breakers: dict[WorkerHandle, Breaker] = {}

    def of(self, worker: WorkerHandle) -> Breaker:
        breaker = self._breakers.get(worker)
        if breaker is None:
            breaker = self._breakers[worker] = Breaker(self.settings)
        return breaker

    def state(self, worker: WorkerHandle) -> BreakerState:
        return self.of(worker).state(self.clock())

    def allows(self, worker: WorkerHandle) -> bool:
        return self.of(worker).allows(self.clock())

    def started(self, worker: WorkerHandle) -> bool:
        return self.of(worker).started(self.clock())

    def ended(self, worker: WorkerHandle, succeeded: bool, probe: bool) -> None:
        self.of(worker).ended(succeeded, probe)

    def failed(self, worker: WorkerHandle) -> None:
        self.of(worker).failed(self.clock())

    def publish(self, metrics: RouterMetrics, workers: Iterable[WorkerHandle]) -> None:
        for w in workers:
            metrics.breaker_state.set(float(self.state(w)), worker=w.url, role=w.role)
