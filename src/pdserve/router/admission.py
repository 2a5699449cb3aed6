"""Admission to one pool of workers: a bounded FIFO queue at the router in front of per-worker
in-flight caps, so that overload is answered at the door (429 or 503 with Retry-After)
instead of by queues inside the workers, where a decode reservation or a finished prefill
waiting for room runs down its KV lease and ends in a recompute that deepens the overload.

A request holds a `Slot` (one place on one worker) from its grant to `release()`; only then
may its legs go to that worker. Invariants:
- A worker holds at most its cap of slots (`capacity.py`), except after `Slot.move` (a retry
  of an admitted request elsewhere is never refused).
- FIFO: a request arriving while others wait queues behind them, and each freed place goes to
  the oldest waiter, whose chooser picks among the workers with room (the routing policy).
- A request that finds the queue at its capacity is refused at once: 429, `queue_full`. One
  that waits its whole allowance: 503, `queue_timeout`. Both carry Retry-After in whole
  seconds from the measured drain rate. Nothing that was granted a slot is refused here.
- A waiter whose caller is cancelled (the client went away) leaves the queue at once; if its
  slot was granted in the same instant, the slot is released, never leaked.

Lifetime: one per pool per router (`dispatch.py`); the event loop's only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.api.errors import SERVER_ERROR, ApiError
from pdserve.api.openai_server import GenerateError
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.capacity import PoolCapacity
from pdserve.router.rate_limit import retry_after
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle

Chooser = Callable[[list[WorkerHandle]], WorkerHandle]
QUEUE_FULL, QUEUE_TIMEOUT = "queue_full", "queue_timeout"


class Overloaded(GenerateError):
    """A request refused by admission, with the whole seconds a client should wait."""

    def __init__(self, message: str, status: int, code: str, retry_after_s: float) -> None:
        super().__init__(f"{message} Please try again in {retry_after(retry_after_s)}s.", status)
        self.code, self.retry_after = code, retry_after(retry_after_s)

    def api_error(self) -> ApiError:
        return ApiError(self.status, str(self), type=SERVER_ERROR, code=self.code,
                        headers={"Retry-After": str(self.retry_after)})


class Slot:
    """A granted place on `worker`, held until `release()` (idempotent)."""

    def __init__(self, queue: AdmissionQueue, worker: WorkerHandle, tokens: int,
                 granted_at: float) -> None:
        self.queue, self.worker, self.tokens, self.granted_at = queue, worker, tokens, granted_at
        self.released = False

    def release(self, completion_tokens: int | None = None) -> None:
        """Frees the place for the next waiter. `completion_tokens` (the KV tokens the request
        added to its prompt's; 0 for a prefill) says it completed: its service time and size
        are measured. None: it failed or was cancelled, nothing is measured."""
        if self.released:
            return
        self.released = True
        q = self.queue
        q.take_back(self.worker)
        if completion_tokens is not None:
            q.capacity.record(q.clock() - self.granted_at, self.tokens + completion_tokens)
        q.admit_waiting()

    def move(self, worker: WorkerHandle) -> None:
        """The request is retried on `worker` (over its cap if need be); its old place frees."""
        if self.released or worker is self.worker:
            return
        self.queue.take_back(self.worker)
        self.queue.hold(worker)
        self.worker = worker
        self.queue.admit_waiting()


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future
    choose: Chooser
    tokens: int
    arrived: float
    timer: asyncio.TimerHandle | None = field(default=None)


class AdmissionQueue:
    """`members()` returns the pool's routable workers now (healthy ones of its roles);
    `expected()` those it counts on (also the ones restarting or behind an open breaker;
    default: the members): the queue's capacity and Retry-After are sized from theirs, so a
    worker's restart does not shrink the queue to nothing while requests wait for it."""

    def __init__(self, pool: str, members: Callable[[], Sequence[WorkerHandle]],
                 settings: AdmissionSettings, metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 expected: Callable[[], Sequence[WorkerHandle]] | None = None) -> None:
        self.pool, self.members, self.settings = pool, members, settings
        self.expected = expected or members
        self.metrics, self.clock = metrics, clock
        self.capacity = PoolCapacity(settings)
        self._held: dict[WorkerHandle, int] = {}
        self._waiting: dict[_Waiter, None] = {}  # insertion order: oldest first

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def held(self, worker: WorkerHandle) -> int:
        return self._held.get(worker, 0)

    def caps(self) -> dict[WorkerHandle, int]:
        return {w: self.capacity.worker_cap(w.info) for w in self.members()}

    def expected_caps(self) -> list[int]:
        return [self.capacity.worker_cap(w.info) for w in self.expected()]

    def queue_capacity(self) -> int:
        return self.capacity.queue_capacity(self.expected_caps())

    async def acquire(self, choose: Chooser, tokens: int, wait_s: float | None = None) -> Slot:
        """A slot on the worker `choose` picks among those with room, at once or after waiting
        at most `wait_s` (default: the max queue wait). Raises Overloaded, or the caller's
        CancelledError (the request has then left the queue and holds nothing)."""
        self.admit_waiting()
        if not self._waiting and (free := self._free()):
            return self._grant(choose, free, tokens, self.clock())
        if self.depth >= self.queue_capacity():
            raise self._refused(429, QUEUE_FULL, f"All {self.pool} workers are busy and the "
                                f"router's queue for them is full ({self.depth} waiting).")
        wait = max(self.settings.max_queue_wait_s if wait_s is None else wait_s, 0.0)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), choose, tokens, self.clock())
        self._waiting[waiter] = None
        waiter.timer = loop.call_later(wait, self._expire, waiter, wait)
        waiter.future.add_done_callback(lambda _: self._leave(waiter))
        self._publish_depth()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # granted in the same instant: give it back
            raise

    def admit_waiting(self) -> None:
        """Grants freed places to the oldest waiters (after a release, or a worker came back)."""
        while self._waiting and (free := self._free()):
            waiter = next(iter(self._waiting))
            self._leave(waiter)
            if waiter.future.done():
                continue
            try:
                slot = self._grant(waiter.choose, free, waiter.tokens, waiter.arrived)
            except Exception as e:  # a chooser's bug fails its own request only
                waiter.future.set_exception(e)
                continue
            waiter.future.set_result(slot)

    def hold(self, worker: WorkerHandle) -> None:
        self._held[worker] = self._held.get(worker, 0) + 1

    def take_back(self, worker: WorkerHandle) -> None:
        left = self._held.get(worker, 0) - 1
        if left > 0:
            self._held[worker] = left
        else:
            self._held.pop(worker, None)

    def _free(self) -> list[WorkerHandle]:
        return [w for w, cap in self.caps().items() if self.held(w) < cap]

    def _grant(self, choose: Chooser, free: list[WorkerHandle], tokens: int,
               arrived: float) -> Slot:
        worker = choose(free)
        if worker not in free:
            raise RuntimeError(f"the chooser picked {worker.name}, which has no free slot")
        self.hold(worker)
        now = self.clock()
        if self.metrics is not None:
            self.metrics.admitted.inc(pool=self.pool)
            self.metrics.queue_wait.observe(max(now - arrived, 0.0), pool=self.pool)
        return Slot(self, worker, tokens, now)

    def _leave(self, waiter: _Waiter) -> None:
        """Takes the waiter out of the queue (granted, expired or cancelled); idempotent."""
        if waiter not in self._waiting:
            return
        del self._waiting[waiter]
        if waiter.timer is not None:
            waiter.timer.cancel()
        self._publish_depth()

    def _expire(self, waiter: _Waiter, wait_s: float) -> None:
        self._leave(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(self._refused(
                503, QUEUE_TIMEOUT, f"No {self.pool} worker had room for the request within "
                                    f"{wait_s:g} s of waiting at the router."))

    def _refused(self, status: int, code: str, message: str) -> Overloaded:
        if self.metrics is not None:
            self.metrics.rejected.inc(pool=self.pool, reason=code)
        wait = self.capacity.retry_after_s(self.depth, self.expected_caps())
        return Overloaded(message, status, code, wait)

    def _publish_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.depth, pool=self.pool)

    def publish(self) -> None:
        """Copies the pool's capacity into the metrics (before /metrics renders)."""
        if self.metrics is None:
            return
        caps = self.caps()
        expected = self.expected_caps()
        self.metrics.queue_capacity.set(self.capacity.queue_capacity(expected), pool=self.pool)
        self.metrics.drain_rate.set(self.capacity.drain_rate(sum(expected)), pool=self.pool)
        for worker, cap in caps.items():
            self.metrics.worker_cap.set(cap, worker=worker.url, role=worker.role)
