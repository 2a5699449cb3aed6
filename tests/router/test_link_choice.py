"""The split decision with two prefill workers behind different links to one decode worker:
each split request's hand-over is learnt for its own pair, a slow link to one prefill worker
sends prompts to the other, every link slow keeps them local, and the router's /metrics shows
each link."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.common.sampling_params import SamplingParams
from pdserve.internal_auth import InternalAuth
from pdserve.legs.protocol import EventBatch, LegKind, LegRequest, TokenEvent
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.dispatch import Dispatcher, DispatchSettings
from pdserve.router.policies import LeastLoaded
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle, WorkerPool
from pdserve.transfer.peer import PeerId
from tests.router.fake_worker import NAME, SECRET, worker_info

PROMPT = list(range(40))  # 40 tokens: 0.04 s on a prefill worker, 0.4 s on the decode worker
PARAMS = SamplingParams(max_tokens=2, temperature=0)
RATES = {"prefill": 1000.0, "decode": 100.0}  # prompt tokens a second


class LinkedLegs:
    """Legs whose KV takes `delay_s[prefill URL]` to reach the decode leg after token 0."""

    def __init__(self, delay_s: dict[str, float]) -> None:
        self.delay_s = delay_s
        self.opened: list[tuple[str, LegKind]] = []
        self._token0: dict[int, asyncio.Event] = {}
        self._sender: dict[int, str] = {}

    async def stream(self, worker: WorkerHandle, leg: LegRequest, idle_s: float
                     ) -> AsyncIterator[EventBatch]:
        self.opened.append((worker.url, leg.kind))
        sent = self._token0.setdefault(leg.transfer_id or 0, asyncio.Event())
        if leg.kind is LegKind.PREFILL:
            self._sender[leg.transfer_id or 0] = worker.url
            sent.set()
            yield [TokenEvent(0, [7], 0, "a", final=True)]
            return
        if leg.kind is LegKind.DECODE:
            await sent.wait()
            await asyncio.sleep(self.delay_s[self._sender[leg.transfer_id or 0]])
        yield [TokenEvent(0, [7], 0, "a"),
               TokenEvent(1, [8], 1, "b", finish_reason="length", final=True)]


def dispatcher(legs: LinkedLegs) -> Dispatcher:
    pool = WorkerPool({"prefill": ["http://p0", "http://p1"], "decode": ["http://d"]},
                      InternalAuth(SECRET), NAME)
    pool.reference = {"kv_layout": worker_info()["kv_layout"]}  # 512 bytes a token
    for port, w in enumerate(pool.workers, 9001):
        w.healthy, w.peer = True, PeerId(port, "127.0.0.1", port)
        w.info = worker_info(w.role, rates={"prefill_tokens_per_s": RATES[w.role]})
    return Dispatcher(pool, LeastLoaded(), DispatchSettings(), legs, RouterMetrics(),
                      AdmissionSettings(max_inflight_per_worker=4, max_queue=4))


def worker(d: Dispatcher, url: str) -> WorkerHandle:
    return next(w for w in d.pool.workers if w.url == url)


async def run(d: Dispatcher) -> None:
    async for _ in d.generate("cmpl-1", PROMPT, PARAMS):
        pass


def test_a_split_request_s_hand_over_is_learnt_for_its_own_pair() -> None:
    async def go() -> None:
        legs = LinkedLegs({"http://p0": 0.05, "http://p1": 0.0})
        d = dispatcher(legs)
        await run(d)  # no link measured: the policy's pick, p0 (least loaded, then URL)
        assert ("http://p0", LegKind.PREFILL) in legs.opened
        fits = d.paths.links.table().fits
        assert list(fits) == [("http://p0", "http://d")]
        assert fits["http://p0", "http://d"].seconds(40 * 512) >= 0.05

    asyncio.run(go())


def test_a_slow_link_sends_prompts_to_the_other_prefill_worker_then_keeps_them_local() -> None:
    async def go() -> None:
        legs = LinkedLegs({"http://p0": 0.0, "http://p1": 0.0})
        d = dispatcher(legs)
        p0, p1, dec = (worker(d, u) for u in ("http://p0", "http://p1", "http://d"))
        d.paths.handed_over(p0, dec, 40, 0.5)  # 0.54 s split through p0 against 0.4 s local
        d.paths.handed_over(p1, dec, 40, 0.001)
        await run(d)
        assert legs.opened[-2:] == [("http://p1", LegKind.PREFILL), ("http://d", LegKind.DECODE)]
        d.paths.handed_over(p1, dec, 40, 2.0)  # p1's link slows too: one such hand-over shows
        await run(d)
        assert legs.opened[-1] == ("http://d", LegKind.LOCAL)
        decisions = d.metrics.split_decisions
        assert decisions.value(path="disaggregated", reason="measured_cost") == 1
        assert decisions.value(path="local", reason="measured_cost") == 1
        d.metrics.bind_pool(d.pool)
        d.metrics.refresh()  # as /metrics does
        text = d.metrics.registry.render()
        # 40 tokens' KV (20 kB) is below MIN_RATE_BYTES: no bandwidth, a fixed cost
        assert ('pdserve_router_link_bytes_per_second{prefill="http://p0",decode="http://d"} '
                '0\n') in text
        assert 'pdserve_router_link_fixed_seconds{prefill="http://p0",decode="http://d"} 0.5\n' \
            in text

    asyncio.run(go())
