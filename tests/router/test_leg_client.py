"""The router's leg channel against a scripted worker: legs share one connection and each gets
only its own events, the events of one message come as one batch, a refusal is a client error,
a leg given up sends `cancel`, a connection that closes fails every leg open on it, and each
connect is signed with the cluster secret (a worker with another secret refuses it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from pdserve.common.sampling_params import SamplingParams
from pdserve.internal_auth import AUTH_HEADER, InternalAuth, PeerRefused
from pdserve.legs.frames import (
    CANCEL,
    OPEN,
    events_reply,
    parse_replies,
    parse_request,
    refusal_reply,
)
from pdserve.legs.protocol import EventBatch, LegRequest, TokenEvent
from pdserve.router.leg_client import LegFailed, RouterLegChannels, parse_events
from pdserve.router.worker_pool import WorkerHandle

LEG = LegRequest("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=5))
SECRET = b"s" * 32


def event(i: int, final: bool = False) -> TokenEvent:
    return TokenEvent(i, [100 + i], i, "x", finish_reason="length" if final else None,
                      final=final)


def test_parse_events_stops_at_the_final_event() -> None:
    lines = [event(0).to_line(), event(1, final=True).to_line(), b"not json"]
    assert parse_events([line.rstrip(b"\n") for line in lines]) == [event(0),
                                                                   event(1, final=True)]
    assert parse_events([]) == []


def test_frames_round_trip_and_malformed_ones_are_refused() -> None:
    op, sid, body = parse_request(b"open 7\n{}")
    assert (op, sid, body) == (OPEN, 7, b"{}")
    assert parse_request(b"cancel 3\n") == (CANCEL, 3, b"")
    lines = event(0).to_line() + event(1).to_line()
    message = events_reply(5, [event(0), event(1)]) + refusal_reply(6, 400, "no\nway")
    assert parse_replies(message) == [(5, 200, lines), (6, 400, b"no\nway")]
    for bad in (b"", b"open\n", b"open x\n", b"close 1\n", b"open 1 2\n"):
        with pytest.raises(ValueError, match="not a leg channel request"):
            parse_request(bad)
    for bad in (b"5\n", b"5 200\nx", b"5 200 1", b"5 200 x\n"):
        with pytest.raises(ValueError, match="not a leg channel reply"):
            parse_replies(bad)
    with pytest.raises(ValueError, match="cut short: 9 bytes announced, 2 there"):
        parse_replies(refusal_reply(5, 400, "no") + b"6 200 9\nab")
    with pytest.raises(ValueError, match="empty"):
        parse_replies(b"")
    with pytest.raises(ValueError, match="4xx"):
        refusal_reply(1, 500, "no")


Script = Callable[[web.WebSocketResponse, int, LegRequest], "asyncio.Future[None]"]


class ScriptedWorker:
    """A worker whose answer to each `open` is `script(ws, sid, leg)`; it records what it
    received and how many connections were made."""

    def __init__(self, script: Script, secret: bytes = SECRET) -> None:
        self.script = script
        self.auth = InternalAuth(secret)
        self.received: list[tuple[str, int]] = []
        self.connections = 0
        self.sockets: list[web.WebSocketResponse] = []
        self.tasks: list[asyncio.Future] = []

    async def legs(self, request: web.Request) -> web.StreamResponse:
        try:  # as the worker does (workers/access.py), before the upgrade
            self.auth.verify(request.method, request.path, request.headers.get(AUTH_HEADER))
        except PeerRefused as e:
            return web.json_response({"error": {"message": str(e)}}, status=401)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        self.sockets.append(ws)
        async for msg in ws:
            assert msg.type is WSMsgType.BINARY
            op, sid, body = parse_request(msg.data)
            self.received.append((op, sid))
            if op == OPEN:
                leg = LegRequest.from_json(json.loads(body))
                self.tasks.append(asyncio.ensure_future(self.script(ws, sid, leg)))
        return ws


@contextlib.asynccontextmanager
async def serving(script: Script, secret: bytes = SECRET
                  ) -> AsyncIterator[tuple[ScriptedWorker, WorkerHandle, RouterLegChannels]]:
    """A scripted worker holding `secret`, and the router's channels (holding SECRET)."""
    worker = ScriptedWorker(script, secret)
    app = web.Application()
    app.router.add_get("/internal/legs", worker.legs)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    async with aiohttp.ClientSession() as session:
        channels = RouterLegChannels(session, InternalAuth(SECRET), connect_s=5.0)
        try:
            yield worker, WorkerHandle(f"http://{host}:{port}", "collocated",
                                       healthy=True), channels
        finally:
            await channels.close()
            await runner.cleanup()


async def collect(channels: RouterLegChannels, w: WorkerHandle, leg: LegRequest = LEG,
                  idle_s: float = 5.0) -> list[EventBatch]:
    return [batch async for batch in channels.stream(w, leg, idle_s)]


def test_legs_share_one_connection_and_get_their_own_events_in_batches() -> None:
    async def script(ws: web.WebSocketResponse, sid: int, leg: LegRequest) -> None:
        base = 10 * int(leg.request_id.split("-")[1])
        await ws.send_bytes(events_reply(sid, [event(base)]))
        await asyncio.sleep(0.01)
        await ws.send_bytes(events_reply(sid, [event(base + 1), event(base + 2, final=True)]))

    async def go() -> None:
        async with serving(script) as (worker, w, channels):
            legs = [LegRequest(f"cmpl-{i}", (1, 2), SamplingParams(max_tokens=3))
                    for i in range(1, 4)]
            got = await asyncio.gather(*(collect(channels, w, leg) for leg in legs))
            for i, batches in enumerate(got, start=1):
                assert batches == [[event(10 * i)],
                                   [event(10 * i + 1), event(10 * i + 2, final=True)]]
            assert worker.connections == 1
            assert sorted(op for op, _ in worker.received) == [OPEN] * 3  # no cancel
            assert w.inflight == 0

    asyncio.run(go())


def test_one_message_carries_the_replies_of_several_legs() -> None:
    """The worker sends every leg a step advanced in one message; each leg gets its own."""
    opened: dict[str, int] = {}
    both = asyncio.Event()

    async def script(ws: web.WebSocketResponse, sid: int, leg: LegRequest) -> None:
        opened[leg.request_id] = sid
        if len(opened) == 2:
            both.set()
            a, b = opened["cmpl-1"], opened["cmpl-2"]
            await ws.send_bytes(events_reply(a, [event(0)]) + events_reply(b, [event(5)]))
            await ws.send_bytes(events_reply(b, [event(6, final=True)]) +
                                events_reply(a, [event(1, final=True)]))

    async def go() -> None:
        async with serving(script) as (_, w, channels):
            legs = [LegRequest(f"cmpl-{i}", (1,), SamplingParams(max_tokens=2))
                    for i in (1, 2)]
            one, two = await asyncio.gather(*(collect(channels, w, leg) for leg in legs))
            assert one == [[event(0)], [event(1, final=True)]]
            assert two == [[event(5)], [event(6, final=True)]]

    asyncio.run(go())


def test_a_refused_leg_is_a_client_error() -> None:
    async def script(ws: web.WebSocketResponse, sid: int, leg: LegRequest) -> None:
        await ws.send_bytes(refusal_reply(sid, 400, "prompt too long"))

    async def go() -> None:
        async with serving(script) as (_, w, channels):
            with pytest.raises(LegFailed, match="prompt too long") as e:
                await collect(channels, w)
            assert e.value.client_error and e.value.status == 400

    asyncio.run(go())


def test_a_leg_given_up_early_or_timed_out_sends_cancel() -> None:
    async def script(ws: web.WebSocketResponse, sid: int, leg: LegRequest) -> None:
        if leg.request_id == "cmpl-early":
            await ws.send_bytes(events_reply(sid, [event(0)]))  # then nothing

    async def go() -> None:
        async with serving(script) as (worker, w, channels):
            early = LegRequest("cmpl-early", (1,), SamplingParams(max_tokens=5))
            async with contextlib.aclosing(channels.stream(w, early, 5.0)) as events:
                assert await anext(events) == [event(0)]
            with pytest.raises(LegFailed, match="timed out"):
                await collect(channels, w, LEG, idle_s=0.2)
            for _ in range(100):
                if len(worker.received) == 4:
                    break
                await asyncio.sleep(0.01)
            assert sorted(worker.received) == [(CANCEL, 1), (CANCEL, 2), (OPEN, 1), (OPEN, 2)]
            assert w.inflight == 0

    asyncio.run(go())


def test_a_closed_connection_fails_every_open_leg_and_the_next_leg_reconnects() -> None:
    async def go() -> None:
        started = asyncio.Event()

        async def script(ws: web.WebSocketResponse, sid: int, leg: LegRequest) -> None:
            if leg.request_id == "cmpl-after":
                await ws.send_bytes(events_reply(sid, [event(0, final=True)]))
                return
            await ws.send_bytes(events_reply(sid, [event(0)]))
            if sid == 2:
                started.set()

        async with serving(script) as (worker, w, channels):
            legs = [asyncio.ensure_future(collect(channels, w, LegRequest(
                f"cmpl-{i}", (1,), SamplingParams(max_tokens=5)))) for i in range(2)]
            await asyncio.wait_for(started.wait(), 5)
            await worker.sockets[0].close()  # the worker goes away mid-stream
            for leg in legs:
                with pytest.raises(LegFailed, match="before its end"):
                    await leg
            after = LegRequest("cmpl-after", (1,), SamplingParams(max_tokens=1))
            assert await collect(channels, w, after) == [[event(0, final=True)]]
            assert worker.connections == 2 and w.inflight == 0

    asyncio.run(go())


def test_an_unreachable_worker_fails_the_leg() -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            channels = RouterLegChannels(session, InternalAuth(SECRET), connect_s=2.0)
            w = WorkerHandle("http://127.0.0.1:9", "collocated", healthy=True)
            with pytest.raises(LegFailed, match="failed") as e:
                await collect(channels, w)
            assert not e.value.client_error and w.inflight == 0
            await channels.close()

    asyncio.run(go())


def test_a_worker_with_another_secret_refuses_the_channel() -> None:
    async def script(ws: web.WebSocketResponse, sid: int, leg: LegRequest) -> None:
        await ws.send_bytes(events_reply(sid, [event(0, final=True)]))

    async def go() -> None:
        async with serving(script, secret=b"o" * 32) as (worker, w, channels):
            with pytest.raises(LegFailed, match="401") as e:
                await collect(channels, w)
            assert not e.value.client_error and w.inflight == 0
            assert worker.connections == 0 and worker.received == []

    asyncio.run(go())

