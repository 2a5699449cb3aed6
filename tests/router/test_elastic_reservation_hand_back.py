"""A decode worker becoming a prefill worker hands back its reservations (decode legs whose KV
has not come) at once instead of waiting for their prefills; with scripted legs
(`scripted_model.py`): the request starts over from where its legs began, its prefill on the
same prefill worker, its decode on another decode worker, and the client sees one stream with
exactly the tokens of an undisturbed run; neither worker is counted as failed, whether the
prefill leg, which the hand-back ends too, says so first or last, and whether it had sent
token 0 already."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from pdserve.legs.protocol import MOVED, EventBatch, LegKind, LegRequest, TokenEvent
from pdserve.router.worker_pool import WorkerHandle
from tests.router.scripted_model import Opened, ScriptedModel, reference
from tests.router.test_dispatch_migration import (
    GREEDY,
    LONG,
    SEEDED,
    collect,
    dispatcher,
    expected_text,
    worker_of,
)

REASON = "handed back by a worker changing role"


@dataclass
class Reserving(ScriptedModel):
    """The first decode leg on `flipping` is handed back before its KV comes, its prefill leg
    ending handed back too (`spoke`: after it sent token 0; `prefill_first`: its final event
    reaches the router before the decode leg's)."""

    flipping: str = "http://d0"
    spoke: bool = False
    prefill_first: bool = False
    _handed: dict[int, asyncio.Event] = field(default_factory=dict)
    _first: set[str] = field(default_factory=set)  # URLs whose first leg was played

    async def stream(self, worker: WorkerHandle, leg: LegRequest, idle_s: float
                     ) -> AsyncIterator[EventBatch]:
        first = worker.url not in self._first
        self._first.add(worker.url)
        handed = self._handed.setdefault(leg.transfer_id or 0, asyncio.Event())
        if first and leg.kind is LegKind.DECODE and worker.url == self.flipping:
            self.opened.append(Opened(worker.url, leg))
            if self.spoke:  # the KV is on its way: the prefill leg sent token 0
                await self._kv.setdefault(leg.transfer_id, asyncio.Event()).wait()
            handed.set()
            if self.prefill_first:
                await asyncio.sleep(0.05)
            yield [TokenEvent(0, [], 0, "", final=True, extra={MOVED: True})]
            return
        if first and leg.kind is LegKind.PREFILL and not self.spoke:
            self.opened.append(Opened(worker.url, leg))
            await handed.wait()  # queued behind other prompts until the decode side gave up
            yield [TokenEvent(0, [], 0, "", final=True, extra={MOVED: True})]
            return
        async for batch in super().stream(worker, leg, idle_s):
            yield batch


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("spoke", "prefill_first"), [(False, False), (False, True),
                                                      (True, False)],
                         ids=["unstarted", "prefill-says-first", "token0-sent"])
def test_a_reservation_handed_back_starts_over_with_another_decode_worker(
        params, spoke: bool, prefill_first: bool) -> None:
    model = Reserving(spoke=spoke, prefill_first=prefill_first)
    d = dispatcher(model)
    out, events = asyncio.run(collect(d, LONG, params))
    want = reference(LONG, 12, params.seed)
    assert out.token_ids == want and out.text == expected_text(want)
    assert out.finish_reason == "length"
    assert [e.index for e in events] == sorted(e.index for e in events)
    assert model.kinds() == [("http://p0", LegKind.PREFILL, "cmpl-1"),
                             ("http://d0", LegKind.DECODE, "cmpl-1"),
                             ("http://p0", LegKind.PREFILL, "cmpl-1.2"),
                             ("http://d1", LegKind.DECODE, "cmpl-1.2")]
    pre, dec = model.legs("http://p0")[-1], model.legs("http://d1")[0]
    # from the prompt again, a new transfer between the prefill worker and the other decoder
    assert pre.prompt_token_ids == dec.prompt_token_ids == tuple(LONG)
    assert pre.output_offset == dec.output_offset == 0 and pre.resume is None
    assert pre.transfer_id == dec.transfer_id != model.legs("http://d0")[0].transfer_id
    assert pre.peer == worker_of(d, "http://d1").peer
    for url in ("http://p0", "http://d0"):
        assert worker_of(d, url).healthy, url  # handing back is no failure, on either side
        assert d.breakers.of(worker_of(d, url)).failures == 0, url
    assert d.metrics.migrations.value(reason=REASON) == 1


def test_with_no_prefill_worker_left_the_decode_worker_prefills_itself() -> None:
    model = Reserving()
    d = dispatcher(model)
    pool_prefill = worker_of(d, "http://p0")

    async def go():
        async def unhealthy_once_handed_back() -> None:
            while not model.legs("http://d0"):
                await asyncio.sleep(0)
            pool_prefill.healthy = False  # it went away meanwhile

        watcher = asyncio.create_task(unhealthy_once_handed_back())
        result = await collect(d, LONG, GREEDY)
        await watcher
        return result

    out, _ = asyncio.run(go())
    assert out.token_ids == reference(LONG, 12)
    assert model.kinds()[2:] == [("http://d1", LegKind.LOCAL, "cmpl-1.2")]
    assert model.legs("http://d1")[0].prompt_token_ids == tuple(LONG)
