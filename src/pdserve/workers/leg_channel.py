"""The worker's end of a router's leg channel (frames: `legs/frames.py`).

Life cycle of a channel: a router connects once (`GET /internal/legs`, WebSocket, signed with
the cluster secret and checked before the upgrade: `workers/access.py`) and keeps the
connection. Each `open` message submits its leg to the engine loop at once, with the
channel as the leg's sink; `cancel` cancels the leg in the engine loop, which frees its blocks.
When the connection closes, or the worker shuts down (`close_all`), every leg still open on it
is cancelled the same way before the handler returns.

Delivery: the engine loop hands each iteration's items to the HTTP thread in one callback
(`EngineLoop._flush`), which puts them into their legs' sinks. A leg's events of that callback
become one reply, and the replies of every leg the iteration advanced leave in one message,
written at the end of that same callback (`delivered`, `start_eagerly`). No task wakes per
leg, and no later turn of the loop: with a task per leg (an earlier design), one stream cost the
worker's HTTP thread 347-366 us per token against 305-316 us on the worker's own OpenAI
endpoint, on the core the engine computes on; with the send two turns later (a call_soon,
then a task), 304-327 us, and 268-292 us written in the callback. Each turn takes the GIL and
the core from the engine thread mid-step: sent in the callback, what the router adds to a
16-token request at one stream went from +1.2..+2.3 ms to a median of +0.8 ms over 11 runs of
`pdserve bench router` (+0.1..+1.3, one outlier at +3.5).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

from aiohttp import WSMsgType, web

from pdserve.eager import start_eagerly
from pdserve.legs.frames import OPEN, events_reply, parse_request, refusal_reply
from pdserve.legs.protocol import LegRequest, TokenEvent
from pdserve.workers.engine_loop import UNAVAILABLE, Accepted, EngineLoop

log = logging.getLogger("pdserve.worker")

MAX_MESSAGE = 64 * 2**20  # an `open` holds the prompt's token ids: as large as a request body
CLOSE_TIMEOUT_S = 1.0  # longest wait for a router's answer to our close (it may be stalled)


class WorkerLegChannels:
    """Every router connection a worker has open."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self._open: set[web.WebSocketResponse] = set()

    async def serve(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, max_msg_size=MAX_MESSAGE,
                                   timeout=CLOSE_TIMEOUT_S)
        await ws.prepare(request)
        self._open.add(ws)
        channel = WorkerLegChannel(ws, self.loop)
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.BINARY:
                    break  # a router sends binary messages only
                op, sid, body = parse_request(msg.data)
                if op == OPEN:
                    channel.open(sid, body)
                else:
                    channel.cancel(sid, "cancelled (the router went away or gave it up)")
        except ValueError as e:
            log.warning("leg channel from %s: %s; closing it", request.remote, e)
        finally:
            self._open.discard(ws)
            await channel.close()
        return ws

    async def close_all(self) -> None:
        """At shutdown: close every channel (their handlers then cancel their legs)."""
        for ws in list(self._open):
            with contextlib.suppress(ConnectionError):
                await ws.close(code=1001, message=b"worker shutting down")


@dataclass(eq=False)
class _OpenLeg:
    req: LegRequest
    accepted: bool = False
    tokens: int = 0  # sent so far


@dataclass(frozen=True)
class _Sink:
    """What the engine loop puts a leg's items into (`EngineLoop.submit`)."""

    channel: WorkerLegChannel
    sid: int

    def put_nowait(self, item: object) -> None:
        self.channel.deliver(self.sid, item)

    def delivered(self) -> None:
        self.channel.flush()


class WorkerLegChannel:
    """The legs of one router connection and the replies not sent yet. Runs on the HTTP
    thread only. A leg is open from its `open` to its final event, its refusal, or its cancel;
    items for a leg that is no longer open are dropped (the engine loop cancels it)."""

    def __init__(self, ws: web.WebSocketResponse, loop: EngineLoop) -> None:
        self.ws, self.loop = ws, loop
        self._legs: dict[int, _OpenLeg] = {}
        self._events: dict[int, list[TokenEvent]] = {}  # by leg, for the next message
        self._refusals: list[bytes] = []
        # sends held back by the router's reading, and the close after a failed send
        self._sends: set[asyncio.Task] = set()

    def open(self, sid: int, body: bytes) -> None:
        try:
            leg = LegRequest.from_json(json.loads(body))
        except ValueError as e:
            self._refuse(sid, f"bad leg request: {e}")
            return
        self._legs[sid] = _OpenLeg(leg)
        self.loop.submit_to(leg, _Sink(self, sid), movable=True)

    def cancel(self, sid: int, why: str) -> None:
        leg = self._legs.pop(sid, None)
        if leg is not None:
            self.loop.cancel(leg.req.request_id)
            self._log(leg, why)

    def deliver(self, sid: int, item: object) -> None:
        leg = self._legs.get(sid)
        if leg is None:
            return
        if isinstance(item, Accepted):
            leg.accepted = True
            return
        assert isinstance(item, TokenEvent)
        if not leg.accepted:  # the engine refused it: it holds nothing for it
            del self._legs[sid]
            self._refuse(sid, item.error or "refused",
                         503 if item.extra.get(UNAVAILABLE) else 400)
            self._log(leg, f"refused: {item.error}")
            return
        self._events.setdefault(sid, []).append(item)
        leg.tokens += len(item.token_ids)
        if item.final:
            del self._legs[sid]
            self._log(leg, "ended")

    async def close(self) -> None:
        """The connection is gone: cancel every open leg, wait for the sends under way."""
        for sid in list(self._legs):
            self.cancel(sid, "cancelled (the router's connection closed)")
        await asyncio.gather(*self._sends, return_exceptions=True)

    def _refuse(self, sid: int, message: str, status: int = 400) -> None:
        """400: the leg itself is at fault; 503: this worker cannot take it now (the router
        sends it elsewhere)."""
        self._refusals.append(refusal_reply(sid, status, message))
        self.flush()

    def flush(self) -> None:
        """Send the replies not sent yet, in one message, now: the frame is written before
        this returns unless the router's side is full (then a task waits to finish it)."""
        if not (self._refusals or self._events):
            return
        message = b"".join(self._refusals) + b"".join(
            events_reply(sid, events) for sid, events in self._events.items())
        self._refusals.clear()
        self._events.clear()
        if self.ws.closed:
            return
        try:
            task = start_eagerly(self.ws.send_bytes(message))
        except Exception as e:  # runs inside the engine loop's delivery: never raise there
            self._send_failed(e)
            return
        if task is not None:
            self._sends.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._sends.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._send_failed(task.exception())

    def _send_failed(self, e: BaseException) -> None:
        """A lost message would leave its legs waiting for the router's leg timeout: close the
        connection, so that the router fails them now and this handler cancels them. A closing
        connection (ConnectionError) is already on that path."""
        if isinstance(e, ConnectionError):
            log.debug("leg channel send failed: %r", e)
            return
        log.warning("leg channel send failed: %r; closing the channel", e)
        task = asyncio.ensure_future(self.ws.close(code=1011, message=b"send failed"))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _log(self, leg: _OpenLeg, outcome: str) -> None:
        """Once per leg, at its end: a line before token 0 would hold the GIL, and the one
        core a pinned worker has, just as the engine starts the leg's step."""
        log.info("request %s: %s leg %s; %d prompt tokens, %d tokens sent", leg.req.request_id,
                 leg.req.kind.value, outcome, len(leg.req.prompt_token_ids), leg.tokens)
