"""The router's leg client against a scripted worker: the events one read finds come as one
batch, in order; a line split across reads waits for its end; the final event ends the leg."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from pdserve.api.legs import EventBatch, LegRequest, TokenEvent
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.leg_client import LegFailed, parse_events, stream_leg
from pdserve.router.worker_pool import WorkerHandle

LEG = LegRequest("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=5))


def event(i: int, final: bool = False) -> TokenEvent:
    return TokenEvent(i, [100 + i], i, "x", finish_reason="length" if final else None,
                      final=final)


def test_parse_events_stops_at_the_final_event() -> None:
    lines = [event(0).to_line(), event(1, final=True).to_line(), b"not json"]
    assert parse_events([line.rstrip(b"\n") for line in lines]) == [event(0),
                                                                   event(1, final=True)]
    assert parse_events([]) == []


@contextlib.asynccontextmanager
async def worker(writes: list[bytes], turns: asyncio.Queue) -> AsyncIterator[WorkerHandle]:
    """A worker whose leg stream is `writes`, each one a write, the next one only once the
    test put something in `turns`."""

    async def legs(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for data in writes:
            await turns.get()
            await resp.write(data)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/internal/legs", legs)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield WorkerHandle(f"http://{host}:{port}", "collocated", healthy=True)
    finally:
        await runner.cleanup()


def batches(writes: list[bytes]) -> list[EventBatch]:
    async def go() -> list[EventBatch]:
        turns: asyncio.Queue = asyncio.Queue()
        out: list[EventBatch] = []
        async with worker(writes, turns) as w, aiohttp.ClientSession() as session:
            turns.put_nowait(None)
            async for batch in stream_leg(session, w, LEG, 5.0, 5.0):
                out.append(batch)
                for _ in writes:  # let the worker write all it has left
                    turns.put_nowait(None)
            assert w.inflight == 0
        return out

    return asyncio.run(go())


def test_events_read_together_come_as_one_batch() -> None:
    e = [event(0), event(1), event(2), event(3, final=True)]
    lines = [x.to_line() for x in e]
    split = len(lines[2]) // 2
    writes = [lines[0], lines[1] + lines[2][:split], lines[2][split:] + lines[3]]
    got = batches(writes)
    assert [x for batch in got for x in batch] == e
    assert got[0] == [e[0]]  # token 0 alone, at once
    assert got[-1][-2:] == e[2:]  # the split line's end came with the final one: one batch


def test_a_leg_that_ends_before_its_final_event_fails() -> None:
    with pytest.raises(LegFailed, match="before its end"):
        batches([event(0).to_line()])
