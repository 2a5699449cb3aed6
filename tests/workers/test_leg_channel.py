"""The worker's end of a leg channel over a real WebSocket, with a real engine loop: a leg
streams to its final event, a bad leg is refused with 400, and a `cancel` or a closed
connection cancels the legs in flight and returns every block to the pool."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from pdserve.common.engine_options import Role
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.legs.frames import cancel_frame, open_frame, parse_replies
from pdserve.legs.protocol import MOVED, LegKind, LegRequest, TokenEvent
from pdserve.workers.engine_loop import Accepted, EngineLoop, _deliver
from pdserve.workers.leg_channel import WorkerLegChannel, WorkerLegChannels
from pdserve.workers.parked import ParkedLegs
from pdserve.workers.worker_metrics import WorkerMetrics
from tests.conftest import KV_BLOCKS
from tests.workers.test_role_flip import Worker

LONG = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model()), dtype="float32", max_model_len=1024,
                               num_kv_blocks=KV_BLOCKS))


@contextlib.asynccontextmanager
async def channel(engine: Engine, metrics: WorkerMetrics | None = None,
                  loop: EngineLoop | None = None
                  ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    loop = loop or EngineLoop(engine, None, metrics or WorkerMetrics("collocated"))
    loop.start(asyncio.get_running_loop())
    channels = WorkerLegChannels(loop)
    app = web.Application()
    app.router.add_get("/internal/legs", channels.serve)
    app.on_shutdown.append(lambda _: channels.close_all())
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(
                f"http://{host}:{port}/internal/legs") as ws:
            yield ws
    finally:
        await runner.cleanup()
        loop.stop()


async def replies(ws: aiohttp.ClientWebSocketResponse, until: int
                  ) -> list[list[tuple[int, int, bytes]]]:
    """The replies of each message, until `until` legs have ended (final event or refusal)."""
    out, ended = [], 0
    while ended < until:
        msg = await asyncio.wait_for(ws.receive(), 30)
        out.append(parse_replies(msg.data))
        for _, status, body in out[-1]:
            if status != 200 or any(TokenEvent.from_line(line).final
                                    for line in body.splitlines()):
                ended += 1
    return out


async def wait_free(engine: Engine) -> None:
    for _ in range(500):
        if engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{engine.block_manager.num_used_blocks} blocks still used")


def test_legs_stream_to_the_end_and_a_bad_leg_is_refused(engine: Engine) -> None:
    async def go() -> None:
        async with channel(engine) as ws:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            await ws.send_bytes(open_frame(1, LegRequest("r1", (3, 4, 5), params)))
            await ws.send_bytes(open_frame(2, LegRequest("r2", (6, 7), params)))
            await ws.send_bytes(b"open 3\n" + json.dumps({"request_id": "r3"}).encode())
            messages = await replies(ws, 3)
            await wait_free(engine)
        got = [reply for message in messages for reply in message]
        refused = [r for r in got if r[0] == 3]
        assert refused[0][1] == 400 and b"bad leg request" in refused[0][2]
        for sid in (1, 2):
            events = [TokenEvent.from_line(line) for s, _, body in got if s == sid
                      for line in body.splitlines()]
            assert sum(len(e.token_ids) for e in events) == 12
            assert events[-1].final and events[-1].finish_reason == "length"
        # the two legs decode in the same steps: each step's two replies share one message
        assert sum(sorted(sid for sid, _, _ in m) == [1, 2] for m in messages) >= 8

    asyncio.run(go())


def test_a_worker_changing_role_refuses_a_leg_as_unavailable_not_as_bad(tiny_model) -> None:
    pre = Worker(tiny_model(), Role.PREFILL, 0x7100)  # with a KV endpoint: it may flip
    dec = Worker(tiny_model(), Role.DECODE, 0x7101)
    prefill = LegRequest("r1", tuple(range(3, 40)), SHORT, LegKind.PREFILL, 0xF1,
                         dec.transport.local)

    async def go() -> None:
        dec.loop.start(asyncio.get_running_loop())
        async with channel(pre.engine, loop=pre.loop) as ws:
            await ws.send_bytes(open_frame(1, prefill))
            await replies(ws, 1)  # token 0; its blocks wait for the decode side
            flip = pre.loop.change_role(Role.COLLOCATED, timeout_s=30)  # waits for the send
            await asyncio.sleep(0.1)
            await ws.send_bytes(open_frame(2, LegRequest("r2", (6, 7), LONG)))
            refused = []
            while not refused:
                got = parse_replies((await asyncio.wait_for(ws.receive(), 30)).data)
                refused = [r for r in got if r[0] == 2]
            assert refused[0][1] == 503 and b"changing role" in refused[0][2]
            decode = dataclasses.replace(prefill, kind=LegKind.DECODE, peer=pre.transport.local)
            sink = dec.loop.submit(decode)
            while not getattr(await asyncio.wait_for(sink.get(), 30), "final", False):
                pass  # the decode side takes the KV: the send ends, and so does the flip
            await asyncio.wait_for(flip, 30)
            await wait_free(pre.engine)

    try:
        asyncio.run(go())
    finally:
        pre.close()
        dec.close()


def test_a_routers_leg_is_handed_back_by_a_worker_becoming_a_prefill_worker(tiny_model
                                                                           ) -> None:
    worker = Worker(tiny_model(), Role.DECODE, 0x7102)
    worker.loop.parked = ParkedLegs(park_s=0.05)  # no continuation comes: released soon

    async def go() -> None:
        async with channel(worker.engine, loop=worker.loop) as ws:
            await ws.send_bytes(open_frame(1, LegRequest("r1", tuple(range(3, 40)), LONG)))
            first = parse_replies((await asyncio.wait_for(ws.receive(), 30)).data)  # it runs
            flip = worker.loop.change_role(Role.PREFILL, timeout_s=30)
            events = [TokenEvent.from_line(line) for got in [first, *await replies(ws, 1)]
                      for _, _, body in got for line in body.splitlines()]
            assert events[-1].final and events[-1].extra == {MOVED: True}
            assert events[-1].error is None and events[-1].index == sum(
                len(e.token_ids) for e in events)
            await asyncio.wait_for(flip, 30)
            await wait_free(worker.engine)

    try:
        asyncio.run(go())
    finally:
        worker.close()


def test_cancel_and_a_closed_connection_free_the_blocks(engine: Engine) -> None:
    metrics = WorkerMetrics("collocated")

    async def go() -> None:
        async with channel(engine, metrics) as ws:
            await ws.send_bytes(open_frame(1, LegRequest("r1", tuple(range(3, 40)), LONG)))
            await ws.send_bytes(open_frame(2, LegRequest("r2", tuple(range(5, 50)), LONG)))
            first = parse_replies((await asyncio.wait_for(ws.receive(), 30)).data)
            assert first[0][1] == 200 and engine.block_manager.num_used_blocks > 0
            await ws.send_bytes(cancel_frame(1))
            await ws.close()  # leg 2 is still running: the worker must cancel it too
            await wait_free(engine)

    asyncio.run(go())
    assert metrics.requests.value(finish_reason="length") == 0  # cancelled, not run out


def test_a_malformed_message_closes_the_channel(engine: Engine) -> None:
    async def go() -> None:
        async with channel(engine) as ws:
            await ws.send_bytes(open_frame(1, LegRequest("r1", tuple(range(3, 40)), LONG)))
            await asyncio.wait_for(ws.receive(), 30)
            await ws.send_bytes(b"hello\n")
            while (msg := await asyncio.wait_for(ws.receive(), 30)).type is \
                    aiohttp.WSMsgType.BINARY:
                pass
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            await wait_free(engine)

    asyncio.run(go())


class _RecordingWs:
    """A WebSocket stand-in whose sends finish at once, as an uncompressed frame's do."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class _Loop:
    """An engine-loop stand-in that only records the legs' sinks."""

    def __init__(self) -> None:
        self.sinks: list = []

    def submit_to(self, req: LegRequest, sink, movable: bool = False) -> None:
        self.sinks.append(sink)

    def cancel(self, request_id: str) -> None:
        pass


def test_a_delivery_is_written_in_one_message_before_its_callback_returns() -> None:
    """No later turn of the HTTP thread's loop (each takes the GIL and the core from the
    engine thread mid-step on a pinned worker)."""
    async def go() -> None:
        ws, loop = _RecordingWs(), _Loop()
        ch = WorkerLegChannel(ws, loop)
        for sid in (1, 2):
            leg = LegRequest(f"r{sid}", (1, 2, 3), SamplingParams(max_tokens=4))
            ch.open(sid, json.dumps(leg.to_json()).encode())
        a, b = loop.sinks
        token = TokenEvent(index=0, token_ids=[7], text_offset=0, text="x")
        _deliver([(a, Accepted()), (b, Accepted()), (a, token), (b, token)])
        assert len(ws.sent) == 1
        assert [(sid, status) for sid, status, _ in parse_replies(ws.sent[0])] == [(1, 200),
                                                                                   (2, 200)]
        _deliver([(b, TokenEvent(index=1, token_ids=[8], text_offset=1, text="y", final=True))])
        assert len(ws.sent) == 2 and parse_replies(ws.sent[1])[0][0] == 2

    asyncio.run(go())


class _BrokenWs(_RecordingWs):
    """A connection whose sends fail at once with something other than a closing connection."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_with: int | None = None

    async def send_bytes(self, data: bytes) -> None:
        raise RuntimeError("the writer is broken")

    async def close(self, code: int, message: bytes) -> None:
        self.closed_with = code


def test_a_failed_send_closes_its_channel_and_the_delivery_goes_on() -> None:
    """Legs whose message was lost would wait out the router's leg timeout: the channel is
    closed instead (the router then fails them at once), and the other channels still get
    their replies from the same delivery."""
    async def go() -> None:
        sinks, sockets = [], [_BrokenWs(), _RecordingWs()]
        for ws in sockets:
            loop = _Loop()
            leg = LegRequest("r", (1, 2, 3), SamplingParams(max_tokens=4))
            WorkerLegChannel(ws, loop).open(1, json.dumps(leg.to_json()).encode())
            sinks += loop.sinks
        token = TokenEvent(index=0, token_ids=[7], text_offset=0, text="x")
        _deliver([(s, Accepted()) for s in sinks] + [(s, token) for s in sinks])
        assert len(sockets[1].sent) == 1
        await asyncio.sleep(0.01)
        assert sockets[0].closed_with == 1011

    asyncio.run(go())
