"""Admission to a pool of workers: per-worker caps, a FIFO queue at the router, 429 when it is
full and 503 when the wait runs out (both with Retry-After from the measured drain rate), a
cancelled waiter leaves at once, a granted-then-cancelled slot is given back, and a finished
request admits the next. Measurements run on an injected clock; nothing asserts a duration."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from pdserve.router.admission import AdmissionQueue, Overloaded, Slot
from pdserve.router.admission_settings import (
    AdmissionSettings,
    add_admission_args,
    admission_from_args,
)
from pdserve.router.capacity import UNMEASURED_SERVICE_S
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(name: str, **info: Any) -> WorkerHandle:
    return WorkerHandle(f"http://{name}", "decode", healthy=True, info=info)


def queue(workers: list[WorkerHandle], clock: Clock | None = None,
          metrics: RouterMetrics | None = None, **settings: Any) -> AdmissionQueue:
    return AdmissionQueue("decode", lambda: [w for w in workers if w.healthy],
                          AdmissionSettings(**settings), metrics, clock or Clock())


def first(free: list[WorkerHandle]) -> WorkerHandle:
    return free[0]


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def waiting(q: AdmissionQueue, n: int) -> list[asyncio.Task[Slot]]:
    """n acquirers, queued in order."""
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(q.acquire(first, 10)))
        await asyncio.sleep(0)
    assert q.depth == n
    return tasks


def test_caps_then_fifo_and_a_finished_request_admits_the_oldest_waiter() -> None:
    async def go() -> None:
        a, b = worker("a"), worker("b")
        q = queue([a, b], max_inflight_per_worker=2, max_queue=10)
        held = [await q.acquire(first, 10) for _ in range(4)]
        assert [s.worker for s in held] == [a, a, b, b]  # two each, then every worker is full
        tasks = await waiting(q, 3)
        held[2].release(5)  # b frees one: the oldest waiter gets it, on b
        await asyncio.sleep(0)
        assert [t.done() for t in tasks] == [True, False, False]
        assert tasks[0].result().worker is b
        held[0].release(5)
        await asyncio.sleep(0)
        assert [t.done() for t in tasks] == [True, True, False]
        assert tasks[1].result().worker is a
        assert (q.held(a), q.held(b), q.depth) == (2, 2, 1)
        held[0].release(5)  # twice: the second is a no-op
        assert q.depth == 1 and not tasks[2].done()
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)

    run(go)


def test_a_freed_slot_goes_to_the_oldest_waiter_not_to_a_newcomer() -> None:
    async def go() -> None:
        a = worker("a")
        q = queue([a], max_inflight_per_worker=1, max_queue=10)
        holder = await q.acquire(first, 10)
        older = (await waiting(q, 1))[0]
        holder.release(1)  # granted to `older` now, though its task has not run yet
        newer = asyncio.create_task(q.acquire(first, 10))
        await asyncio.sleep(0)
        assert older.done() and not newer.done()
        older.result().release(1)
        assert (await newer).worker is a

    run(go)


def test_a_full_queue_refuses_with_429_and_retry_after_from_the_measured_drain_rate() -> None:
    async def go() -> None:
        clock, metrics = Clock(), RouterMetrics()
        a = worker("a")
        q = queue([a], clock, metrics, max_inflight_per_worker=1, max_queue=1)
        slot = await q.acquire(first, 10)
        clock.now += 10.0  # a 10 s request: 1 slot / 10 s = 0.1 requests a second
        slot.release(5)
        holder = await q.acquire(first, 10)
        tasks = await waiting(q, 1)
        with pytest.raises(Overloaded) as refused:
            await q.acquire(first, 10)
        e = refused.value
        assert (e.status, e.code, e.retry_after) == (429, "queue_full", 20)  # (1 + 1) / 0.1
        error = e.api_error()
        assert error.headers == {"Retry-After": "20"}
        assert error.body()["error"]["code"] == "queue_full"
        assert error.body()["error"]["message"].endswith("Please try again in 20s.")
        assert metrics.rejected.value(pool="decode", reason="queue_full") == 1
        assert metrics.admitted.value(pool="decode") == 2
        holder.release(5)
        (await tasks[0]).release(5)

    run(go)


def test_max_queue_zero_refuses_at_once_when_every_worker_is_at_its_cap() -> None:
    async def go() -> None:
        q = queue([worker("a")], max_inflight_per_worker=1, max_queue=0)
        slot = await q.acquire(first, 10)
        with pytest.raises(Overloaded, match="queue for them is full"):
            await q.acquire(first, 10)
        slot.release(1)
        (await q.acquire(first, 10)).release(1)

    run(go)


def test_a_wait_past_the_allowance_is_503_and_leaves_the_queue() -> None:
    async def go() -> None:
        metrics = RouterMetrics()
        q = queue([worker("a")], metrics=metrics, max_inflight_per_worker=1, max_queue=5,
                  max_queue_wait_s=0.01)
        slot = await q.acquire(first, 10)
        with pytest.raises(Overloaded) as refused:
            await q.acquire(first, 10)
        assert (refused.value.status, refused.value.code) == (503, "queue_timeout")
        assert refused.value.retry_after >= 1
        assert "within 0.01 s" in str(refused.value)
        assert q.depth == 0
        assert metrics.rejected.value(pool="decode", reason="queue_timeout") == 1
        assert metrics.queue_depth.value(pool="decode") == 0
        with pytest.raises(Overloaded, match="within 0 s"):
            await q.acquire(first, 10, wait_s=0.0)  # what a split request has left
        slot.release(1)

    run(go)


def test_a_cancelled_waiter_leaves_at_once_and_the_next_one_gets_the_slot() -> None:
    async def go() -> None:
        a = worker("a")
        q = queue([a], max_inflight_per_worker=1, max_queue=5)
        holder = await q.acquire(first, 10)
        gone, next_one = await waiting(q, 2)
        gone.cancel()  # the client went away
        await asyncio.gather(gone, return_exceptions=True)
        assert q.depth == 1
        holder.release(1)
        slot = await next_one
        assert slot.worker is a and q.held(a) == 1
        slot.release(1)
        assert q.held(a) == 0

    run(go)


def test_a_slot_granted_as_its_waiter_is_cancelled_is_given_back() -> None:
    async def go() -> None:
        a = worker("a")
        q = queue([a], max_inflight_per_worker=1, max_queue=5)
        holder = await q.acquire(first, 10)
        (task,) = await waiting(q, 1)
        holder.release(1)  # grants the waiter's future...
        task.cancel()  # ...and the client goes away before the waiter ran
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert q.held(a) == 0 and q.depth == 0
        (await q.acquire(first, 10)).release(1)

    run(go)


def test_a_retry_moves_the_slot_and_the_old_place_admits_a_waiter() -> None:
    async def go() -> None:
        a, b = worker("a"), worker("b")
        q = queue([a, b], max_inflight_per_worker=1, max_queue=5)
        on_a, on_b = await q.acquire(first, 10), await q.acquire(first, 10)
        (task,) = await waiting(q, 1)
        a.healthy = False  # a failed: the request is retried on b, over b's cap
        on_a.move(b)
        assert (q.held(a), q.held(b)) == (0, 2) and not task.done()
        a.healthy = True  # a's next health check
        q.admit_waiting()
        assert (await task).worker is a
        for slot in (on_a, on_b, task.result()):
            slot.release(None)
        assert (q.held(a), q.held(b)) == (0, 0)

    run(go)


def test_a_waiter_is_admitted_when_a_worker_comes_back() -> None:
    async def go() -> None:
        a = worker("a")
        a.healthy = False
        q = queue([a], max_inflight_per_worker=1, max_queue=5)
        (task,) = await waiting(q, 1)
        a.healthy = True
        q.admit_waiting()  # what the health round calls
        assert (await task).worker is a

    run(go)


def test_queue_capacity_is_the_measured_drain_rate_times_the_max_wait() -> None:
    async def go() -> None:
        clock = Clock()
        q = queue([worker("a"), worker("b")], clock, max_inflight_per_worker=4,
                  max_queue_wait_s=2.0)
        slots = 8  # two workers, four each
        assert q.queue_capacity() == int(slots / UNMEASURED_SERVICE_S * 2.0)  # before any
        held = [await q.acquire(first, 10) for _ in range(3)]
        clock.now += 0.5
        for slot in held:
            slot.release(10)  # every request took 0.5 s: 8 / 0.5 = 16 a second
        assert q.queue_capacity() == 32  # 16 a second x 2 s
        failed = await q.acquire(first, 10)
        clock.now += 100.0
        failed.release(None)  # a failure or a cancel is not a completion: not measured
        assert q.queue_capacity() == 32

    run(go)


def test_worker_cap_is_its_batch_limit_then_what_fits_its_kv_pool() -> None:
    async def go() -> None:
        small = worker("small", kv_blocks_total=36, block_size=16)  # 576 tokens of KV
        q = queue([small])
        assert q.caps() == {small: 64}  # the worker default batch limit, nothing measured
        small.info["max_num_seqs"] = 8
        assert q.caps() == {small: 8}
        slot = await q.acquire(first, 200)
        slot.release(40)  # 240 tokens a request: 576 // 240 = 2 fit
        assert q.caps() == {small: 2}
        fixed = queue([small], max_inflight_per_worker=5)
        assert fixed.caps() == {small: 5}

    run(go)


def test_metrics_name_depth_admissions_refusals_and_waits() -> None:
    async def go() -> None:
        metrics = RouterMetrics()
        a = worker("a")
        q = queue([a], metrics=metrics, max_inflight_per_worker=1, max_queue=3)
        holder = await q.acquire(first, 10)
        tasks = await waiting(q, 2)
        assert metrics.queue_depth.value(pool="decode") == 2
        holder.release(1)
        (await tasks[0]).release(1)
        (await tasks[1]).release(1)
        q.publish()
        text = metrics.registry.render()
        for line in ('pdserve_router_queue_depth{pool="decode"} 0',
                     'pdserve_router_admitted_total{pool="decode"} 3',
                     'pdserve_router_queue_wait_seconds_count{pool="decode"} 3',
                     'pdserve_router_queue_capacity{pool="decode"} 3',
                     'pdserve_router_worker_inflight_cap{worker="http://a",role="decode"} 1'):
            assert line in text.splitlines(), line

    run(go)


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_queue": -1}, "--max-queue must be an integer >= 0"),
    ({"max_queue_wait_s": 0}, "--max-queue-wait-s must be a number of seconds > 0"),
    ({"max_queue_wait_s": float("inf")}, "--max-queue-wait-s"),
    ({"max_inflight_per_worker": 0}, "--max-inflight-per-worker must be an integer >= 1"),
])
def test_bad_settings_name_the_flag(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdmissionSettings(**settings)


def test_the_router_flags_set_the_admission_settings() -> None:
    p = argparse.ArgumentParser()
    add_admission_args(p)
    argv = ["--max-queue", "3", "--max-queue-wait-s", "2.5", "--max-inflight-per-worker", "4"]
    assert admission_from_args(p.parse_args(argv)) == AdmissionSettings(3, 2.5, 4)
    assert admission_from_args(p.parse_args([])) == AdmissionSettings()
    with pytest.raises(ValueError, match="--max-inflight-per-worker"):
        admission_from_args(p.parse_args(["--max-inflight-per-worker", "0"]))
