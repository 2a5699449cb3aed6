"""The worker's end of a router's leg channel (frames: `api/leg_frames.py`).

Life cycle of a channel: a router connects once (`GET /internal/legs`, WebSocket) and keeps
the connection. Each `open` message submits its leg to the engine loop at once and starts a
task that sends the leg's events, those that were ready together in one message; `cancel`
cancels that task. A task that ends before its final event (cancelled, or its message could
not be sent) cancels its leg in the engine loop, which frees the leg's blocks. When the
connection closes, or the worker shuts down (`close_all`), every task it started is cancelled
and awaited before the handler returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import WSMsgType, web

from pdserve.api.leg_frames import OPEN, events_frame, parse_request, refusal_frame
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
        tasks: dict[int, asyncio.Task] = {}
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.BINARY:
                    break  # a router sends binary messages only
                op, sid, body = parse_request(msg.data)
                if op == OPEN:
                    tasks[sid] = self._open_leg(ws, sid, body)
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

    def _open_leg(self, ws: web.WebSocketResponse, sid: int, body: bytes) -> asyncio.Task:
        """Submit the leg to the engine loop now (its thread picks it up while this loop
        reads on) and return the task that relays its events."""
        try:
            leg = LegRequest.from_json(json.loads(body))
        except ValueError as e:
            return asyncio.create_task(_send(ws, refusal_frame(sid, 400,
                                                               f"bad leg request: {e}")))
        task = asyncio.create_task(self._relay(ws, sid, leg, self.loop.submit(leg)))
        task.add_done_callback(lambda t: self._cancelled_early(t, leg))
        return task

    def _cancelled_early(self, task: asyncio.Task, leg: LegRequest) -> None:
        """A task cancelled before its first step never opened the leg's event stream, whose
        closing cancels the leg: do it here (cancelling a leg twice, or one that ended, does
        nothing)."""
        if task.cancelled():
            self.loop.cancel(leg.request_id)

    async def _relay(self, ws: web.WebSocketResponse, sid: int, leg: LegRequest,
                     sink: asyncio.Queue) -> None:
        """Logged once, at its end: a log line before token 0 would hold the GIL, and the
        one core a pinned worker has, just as the engine starts the leg's step."""
        tokens, outcome = 0, "cancelled (the router went away or gave it up)"
        try:
            async with contextlib.aclosing(self.loop.events(leg.request_id, sink)) as legs:
                async for events in legs:  # closed early, it cancels the leg
                    if not await _send(ws, events_frame(sid, events)):
                        break
                    tokens += sum(len(e.token_ids) for e in events)
                    if any(e.final for e in events):
                        outcome = "ended"
        except LegRefused as e:
            outcome = f"refused: {e}"
            await _send(ws, refusal_frame(sid, 400, str(e)))
        finally:
            log.info("request %s: %s leg %s; %d prompt tokens, %d tokens sent", leg.request_id,
                     leg.kind.value, outcome, len(leg.prompt_token_ids), tokens)


async def _send(ws: web.WebSocketResponse, data: bytes) -> bool:
    """False if the connection is gone."""
    try:
        await ws.send_bytes(data)
        return True
    except ConnectionError:
        return False


def _forget(tasks: dict[int, asyncio.Task], sid: int, task: asyncio.Task) -> None:
    if tasks.get(sid) is task:
        del tasks[sid]
