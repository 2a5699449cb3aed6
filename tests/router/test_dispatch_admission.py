"""The dispatcher's use of admission, with scripted legs: a split request holds a decode slot
for its whole life and a prefill slot only until its prefill leg ends; a split request that
finds the prefill pool full waits there and, refused, gives its decode slot back before any
leg went out; a retry elsewhere moves its slot instead of queueing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.internal_auth import InternalAuth
from pdserve.legs.protocol import EventBatch, LegKind, LegRequest, TokenEvent
from pdserve.router.admission import Overloaded
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.dispatch import Dispatcher, DispatchSettings, NoWorkers
from pdserve.router.leg_client import LegFailed
from pdserve.router.policies import LeastLoaded
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle, WorkerPool
from pdserve.transfer.peer import PeerId
from tests.router.fake_worker import NAME, SECRET, worker_info

LONG = list(range(40))  # over the threshold: split
SHORT = [1, 2]  # at most the threshold: whole on a decode worker
PARAMS = SamplingParams(max_tokens=2, temperature=0)


class ScriptedLegs:
    """Legs that answer at once, except where a gate (worker URL, leg kind) holds them."""

    def __init__(self) -> None:
        self.gates: dict[tuple[str, LegKind], asyncio.Event] = {}
        self.failing: set[str] = set()  # URLs whose local legs fail before any token
        self.opened: list[tuple[str, LegKind]] = []

    def gate(self, url: str, kind: LegKind) -> asyncio.Event:
        return self.gates.setdefault((url, kind), asyncio.Event())

    async def stream(self, worker: WorkerHandle, leg: LegRequest, idle_s: float
                     ) -> AsyncIterator[EventBatch]:
        self.opened.append((worker.url, leg.kind))
        gate = self.gates.get((worker.url, leg.kind))
        if leg.kind is LegKind.DECODE:
            yield [TokenEvent(0, [7], 0, "a")]
        if leg.kind is LegKind.LOCAL and worker.url in self.failing:
            raise LegFailed(f"local leg on {worker.url} failed")
        if gate is not None:
            await gate.wait()
        if leg.kind is LegKind.PREFILL:
            yield [TokenEvent(0, [7], 0, "a", final=True)]
        else:
            yield [TokenEvent(0, [7], 0, "a"),
                   TokenEvent(1, [8], 1, "b", finish_reason="length", final=True)]


def dispatcher(legs: ScriptedLegs, decode: int = 1, **admission: object) -> Dispatcher:
    pool = WorkerPool({"prefill": ["http://p"],
                       "decode": [f"http://d{i}" for i in range(decode)]},
                      InternalAuth(SECRET), NAME)
    for port, w in enumerate(pool.workers, 9001):
        w.healthy, w.info, w.peer = True, worker_info(w.role), PeerId(port, "127.0.0.1", port)
    settings = AdmissionSettings(**{"max_inflight_per_worker": 1, "max_queue": 4, **admission})
    return Dispatcher(pool, LeastLoaded(), DispatchSettings(local_prefill_threshold=4), legs,
                      RouterMetrics(), settings)


def worker(d: Dispatcher, url: str) -> WorkerHandle:
    return next(w for w in d.pool.workers if w.url == url)


async def run(d: Dispatcher, prompt: list[int]) -> list[TokenEvent]:
    return [e async for batch in d.generate("cmpl-1", prompt, PARAMS) for e in batch]


async def until(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


def test_a_split_request_frees_its_prefill_slot_when_the_prefill_leg_ends() -> None:
    async def go() -> None:
        legs = ScriptedLegs()
        d = dispatcher(legs)
        pre, dec = worker(d, "http://p"), worker(d, "http://d0")
        decode_gate = legs.gate(dec.url, LegKind.DECODE)
        task = asyncio.create_task(run(d, LONG))
        await until(lambda: (dec.url, LegKind.DECODE) in legs.opened, "legs sent")
        await until(lambda: d.queues["prefill"].held(pre) == 0, "prefill slot freed")
        assert d.queues["decode"].held(dec) == 1  # the request still decodes
        decode_gate.set()
        events = await task
        assert events[-1].final and events[-1].index == 1
        assert d.queues["decode"].held(dec) == 0
        assert d.metrics.requests.value(path="disaggregated") == 1

    asyncio.run(go())


def test_a_split_request_refused_by_the_prefill_queue_gives_its_decode_slot_back() -> None:
    async def go() -> None:
        legs = ScriptedLegs()
        d = dispatcher(legs, decode=2, max_queue_wait_s=0.05)
        pre = worker(d, "http://p")
        legs.gate(pre.url, LegKind.PREFILL)  # the first split request's legs never end
        legs.gate("http://d0", LegKind.DECODE)
        first = asyncio.create_task(run(d, LONG))
        await until(lambda: d.queues["prefill"].held(pre) == 1, "first holds the prefill")
        with pytest.raises(Overloaded) as refused:
            await run(d, [t + 1 for t in LONG])
        assert (refused.value.status, refused.value.code) == (503, "queue_timeout")
        assert "No prefill worker had room" in str(refused.value)
        assert d.queues["decode"].held(worker(d, "http://d1")) == 0  # given back
        assert [url for url, _ in legs.opened].count("http://d1") == 0  # no leg went out
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert d.queues["prefill"].held(pre) == 0
        assert all(d.queues["decode"].held(w) == 0 for w in d.pool.workers)

    asyncio.run(go())


def test_a_local_retry_moves_the_slot_to_the_other_worker() -> None:
    async def go() -> None:
        legs = ScriptedLegs()
        d = dispatcher(legs, decode=2)
        d0, d1 = worker(d, "http://d0"), worker(d, "http://d1")
        legs.failing.add(d0.url)
        gate = legs.gate(d1.url, LegKind.LOCAL)
        task = asyncio.create_task(run(d, SHORT))
        await until(lambda: (d1.url, LegKind.LOCAL) in legs.opened, "retried on d1")
        q = d.queues["decode"]
        assert (q.held(d0), q.held(d1), d0.healthy) == (0, 1, False)
        gate.set()
        assert (await task)[-1].final
        assert (q.held(d0), q.held(d1)) == (0, 0)
        # one arrival, at the worker the request first went to: the retry is no new prompt
        sent = d.paths.backlog.sent()
        assert sum(s.prompts for s in sent.values()) == 1 and sent[d0.key].prompts == 1
        assert d.paths.backlog.tokens(d1.key) == 0  # its backlog came and went

    asyncio.run(go())


def test_a_request_waits_for_a_decode_worker_that_is_coming_back() -> None:
    async def go() -> None:
        d = dispatcher(ScriptedLegs())
        dec = worker(d, "http://d0")
        dec.healthy = False  # restarting: its supervisor brings it back
        task = asyncio.create_task(run(d, SHORT))
        await asyncio.sleep(0.05)
        assert not task.done() and d.queues["decode"].depth == 1
        dec.healthy = True
        d.admit_waiting()  # the health round that finds it answering again
        events = await asyncio.wait_for(task, 5)
        assert [t for e in events for t in e.token_ids] == [7, 8]

    asyncio.run(go())


def test_a_request_fails_at_once_when_no_worker_is_expected_back() -> None:
    async def go() -> None:
        d = dispatcher(ScriptedLegs())
        dec = worker(d, "http://d0")
        dec.healthy, dec.refused = False, "does not share the cluster secret"
        with pytest.raises(NoWorkers, match="no healthy decode"):
            await asyncio.wait_for(run(d, SHORT), 5)

    asyncio.run(go())


def test_a_request_whose_only_worker_died_waits_for_it_to_come_back() -> None:
    async def go() -> None:
        legs = ScriptedLegs()
        d = dispatcher(legs)
        dec = worker(d, "http://d0")
        legs.failing.add(dec.url)  # killed: its leg fails, the router marks it failed
        task = asyncio.create_task(run(d, SHORT))
        await until(lambda: not dec.healthy, "marked failed")
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting for it, not failed at once
        assert d.queues["decode"].queue_capacity() > 0  # sized from the worker it expects
        legs.failing.clear()
        dec.healthy = True  # restarted by its supervisor
        events = await asyncio.wait_for(task, 5)
        assert [t for e in events for t in e.token_ids] == [7, 8]
        assert [url for url, kind in legs.opened if kind is LegKind.LOCAL] == [dec.url] * 2

    asyncio.run(go())
