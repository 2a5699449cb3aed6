"""The worker's end of a router's leg channel (frames: `api/leg_frames.py`).

Life cycle of a channel: a router connects once (`GET /internal/legs`, WebSocket) and keeps
the connection. Each `open` message submits its leg to the engine loop at once and starts a
task that sends the leg's events, those that were ready together in one reply; `cancel`
cancels that task. Replies go through the connection's `Outbox`: those of every leg a step
advanced leave in one message. A task that ends before its final event (cancelled, or its
reply could not be sent) cancels its leg in the engine loop, which frees the leg's blocks. When the
connection closes, or the worker shuts down (`close_all`), every task it started is cancelled
and awaited before the handler returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import WSMsgType, web

from pdserve.api.leg_frames import OPEN, events_reply, parse_request, refusal_reply
from pdserve.api.legs import LegRequest
from pdserve.workers.engine_loop import EngineLoop, LegRefused

log = logging.getLogger("pdserve.worker")

MAX_MESSAGE = 64 * 2**20  # an `open` holds the prompt's token ids: as large as a request body
CLOSE_TIMEOUT_S = 1.0  # longest wait for a router's answer to our close (it may be stalled)


class LegChannels:
    """Every router connection a worker has open."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self._open: set[web.WebSocketResponse] = set()

    async def serve(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, max_msg_size=MAX_MESSAGE,
                                   timeout=CLOSE_TIMEOUT_S)
        await ws.prepare(request)
        self._open.add(ws)
        outbox = Outbox(ws)
        tasks: dict[int, asyncio.Task] = {}
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.BINARY:
                    break  # a router sends binary messages only
                op, sid, body = parse_request(msg.data)
                if op == OPEN:
                    tasks[sid] = self._open_leg(outbox, sid, body)
                    tasks[sid].add_done_callback(lambda t, sid=sid: _forget(tasks, sid, t))
                elif sid in tasks:
                    tasks.pop(sid).cancel()
        except ValueError as e:
            log.warning("leg channel from %s: %s; closing it", request.remote, e)
        finally:
            self._open.discard(ws)
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        return ws

    async def close_all(self) -> None:
        """At shutdown: close every channel (their handlers then cancel their legs)."""
        for ws in list(self._open):
            with contextlib.suppress(ConnectionError):
                await ws.close(code=1001, message=b"worker shutting down")

    def _open_leg(self, outbox: Outbox, sid: int, body: bytes) -> asyncio.Task:
        """Submit the leg to the engine loop now (its thread picks it up while this loop
        reads on) and return the task that relays its events."""
        try:
            leg = LegRequest.from_json(json.loads(body))
        except ValueError as e:
            return asyncio.create_task(outbox.send(refusal_reply(sid, 400,
                                                                 f"bad leg request: {e}")))
        task = asyncio.create_task(self._relay(outbox, sid, leg, self.loop.submit(leg)))
        task.add_done_callback(lambda t: self._cancelled_early(t, leg))
        return task

    def _cancelled_early(self, task: asyncio.Task, leg: LegRequest) -> None:
        """A task cancelled before its first step never opened the leg's event stream, whose
        closing cancels the leg: do it here (cancelling a leg twice, or one that ended, does
        nothing)."""
        if task.cancelled():
            self.loop.cancel(leg.request_id)

    async def _relay(self, outbox: Outbox, sid: int, leg: LegRequest,
                     sink: asyncio.Queue) -> None:
        """Logged once, at its end: a log line before token 0 would hold the GIL, and the
        one core a pinned worker has, just as the engine starts the leg's step."""
        tokens, outcome = 0, "cancelled (the router went away or gave it up)"
        try:
            async with contextlib.aclosing(self.loop.events(leg.request_id, sink)) as legs:
                async for events in legs:  # closed early, it cancels the leg
                    if not await outbox.send(events_reply(sid, events)):
                        break
                    tokens += sum(len(e.token_ids) for e in events)
                    if any(e.final for e in events):
                        outcome = "ended"
        except LegRefused as e:
            outcome = f"refused: {e}"
            await outbox.send(refusal_reply(sid, 400, str(e)))
        finally:
            log.info("request %s: %s leg %s; %d prompt tokens, %d tokens sent", leg.request_id,
                     leg.kind.value, outcome, len(leg.prompt_token_ids), tokens)


class Outbox:
    """One connection's replies, sent together: a reply added while the event loop runs the
    callbacks of one pass (the engine loop's delivery of a step wakes every leg it advanced in
    one pass) leaves in the message a task started by the pass's first reply sends after them.
    At 64 streams that is one send a step on the worker's one core instead of 64.

    Order: a leg's next reply waits for its previous one's send, and sends write to the socket
    in the order they start (uncompressed WebSocket frames are written synchronously)."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self._replies: list[bytes] = []
        self._sent: asyncio.Future[bool] | None = None
        self._sending: set[asyncio.Task] = set()  # referenced until done

    async def send(self, reply: bytes) -> bool:
        """Once the message holding `reply` is written; False if the connection is gone."""
        if self._sent is None:
            self._sent = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(self._send_all())  # runs after the legs woken with us
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._replies.append(reply)
        return await asyncio.shield(self._sent)

    async def _send_all(self) -> None:
        replies, self._replies, sent, self._sent = self._replies, [], self._sent, None
        ok = False
        try:
            await self.ws.send_bytes(b"".join(replies))
            ok = True
        except ConnectionError:
            pass  # the connection is gone
        finally:
            sent.set_result(ok)  # also when cancelled at shutdown


def _forget(tasks: dict[int, asyncio.Task], sid: int, task: asyncio.Task) -> None:
    if tasks.get(sid) is task:
        del tasks[sid]
