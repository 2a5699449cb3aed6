"""The router's end of its leg channels: one WebSocket per worker carries all the legs the
router has open there (frames: `legs/frames.py`).

A channel connects on its first leg, and again on the first leg after it closed (a worker that
restarted gets a new connection); each connect is a signed upgrade request (`internal_auth.py`:
the worker accepts a leg channel only from a holder of the cluster secret). Its reader
delivers each message to its leg's queue; when the connection closes, every leg still open on
it fails. A leg's events come in batches: the events the worker had ready together, in one
reply (a message holds the replies of every leg one step advanced).

Bounded: connecting takes at most `connect_s`, and a leg that stays silent for `idle_s` fails
(the worker's own transfer leases are shorter, so a healthy worker always speaks first).
Closing a leg's iterator before its final event (the client went away, the other leg finished
the request, or the leg timed out) sends `cancel`, and the worker cancels the leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import aiohttp

from pdserve.internal_auth import InternalAuth
from pdserve.legs.frames import cancel_frame, open_frame, parse_replies
from pdserve.legs.protocol import EventBatch, LegRequest, TokenEvent
from pdserve.router.worker_pool import WorkerHandle

log = logging.getLogger("pdserve.router")

LEGS_PATH = "/internal/legs"
LOST = 0  # the status a leg's queue gets when its connection closed
CLOSE_TIMEOUT = aiohttp.ClientWSTimeout(ws_close=1.0)  # a stalled worker cannot hold us long


class LegFailed(Exception):
    """A leg ended without its final event. `status` is the worker's status when it refused
    the leg (4xx: the request is at fault, retrying elsewhere will not help)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def client_error(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


class RouterLegChannel:
    """The connection to one worker. Legs on it are numbered by `_ids`; `_legs` maps an open
    leg to its connection and its queue of (status, body) messages."""

    def __init__(self, session: aiohttp.ClientSession, auth: InternalAuth, worker: WorkerHandle,
                 connect_s: float) -> None:
        self.session, self.auth, self.worker, self.connect_s = session, auth, worker, connect_s
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._connecting = asyncio.Lock()
        self._ids = itertools.count(1)
        self._legs: dict[int, tuple[aiohttp.ClientWebSocketResponse, asyncio.Queue]] = {}
        self._tasks: set[asyncio.Task] = set()  # the reader and pending `cancel` sends

    async def stream(self, leg: LegRequest, idle_s: float) -> AsyncIterator[EventBatch]:
        """The leg's events, in batches; the last batch ends with the final event."""
        sid, queue, ws, finished = next(self._ids), asyncio.Queue(), None, False
        self.worker.inflight += 1
        try:
            ws = await self._connection()
            self._legs[sid] = (ws, queue)
            await ws.send_bytes(open_frame(sid, leg))
            while not finished:
                async with asyncio.timeout(idle_s):
                    status, body = await queue.get()
                batch = self._batch(leg, status, body)
                finished = batch[-1].final
                yield batch
        except (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError) as e:
            kind = "timed out" if isinstance(e, TimeoutError) else f"failed: {e!r}"
            raise LegFailed(f"{leg.kind.value} leg on {self.worker.name} {kind}") from e
        finally:
            self.worker.inflight -= 1
            self._legs.pop(sid, None)
            if not finished and ws is not None and not ws.closed:
                self._spawn(ws.send_bytes(cancel_frame(sid)))

    def _batch(self, leg: LegRequest, status: int, body: bytes) -> EventBatch:
        if status == LOST:
            raise LegFailed(f"{self.worker.name} closed the {leg.kind.value} leg before its "
                            f"end ({body.decode(errors='replace')})")
        if status != 200:
            raise LegFailed(body.decode(errors="replace") or f"status {status}", status)
        batch = parse_events(body.split(b"\n")[:-1])
        if not batch:
            raise ValueError("a reply without events")
        return batch

    async def _connection(self) -> aiohttp.ClientWebSocketResponse:
        async with self._connecting:
            if self._ws is None or self._ws.closed:
                async with asyncio.timeout(self.connect_s):
                    self._ws = await self.session.ws_connect(
                        f"{self.worker.url}{LEGS_PATH}", compress=0, max_msg_size=0,
                        timeout=CLOSE_TIMEOUT, headers=self.auth.headers("GET", LEGS_PATH))
                self._spawn(self._read(self._ws))
            return self._ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        why = "the connection closed"
        try:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    why = f"an unexpected {msg.type.name} message"
                    break
                for sid, status, body in parse_replies(msg.data):
                    if sid in self._legs:
                        self._legs[sid][1].put_nowait((status, body))
        except ValueError as e:
            why = str(e)
        finally:
            for on, queue in list(self._legs.values()):
                if on is ws:
                    queue.put_nowait((LOST, why.encode()))
            with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                await ws.close()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("leg channel to %s: %r", self.worker.name, task.exception())

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class RouterLegChannels:
    """The router's channel to each worker, made on first use."""

    def __init__(self, session: aiohttp.ClientSession, auth: InternalAuth,
                 connect_s: float) -> None:
        self.session, self.auth, self.connect_s = session, auth, connect_s
        self._channels: dict[WorkerHandle, RouterLegChannel] = {}

    def stream(self, worker: WorkerHandle, leg: LegRequest, idle_s: float
               ) -> AsyncIterator[EventBatch]:
        channel = self._channels.get(worker)
        if channel is None:
            channel = self._channels[worker] = RouterLegChannel(self.session, self.auth,
                                                                worker, self.connect_s)
        return channel.stream(leg, idle_s)

    async def drop(self, worker: WorkerHandle) -> None:
        """Closes and forgets the channel to a worker that left the pool (legs still open on
        it fail)."""
        channel = self._channels.pop(worker, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))


def parse_events(lines: list[bytes]) -> EventBatch:
    """The events of complete NDJSON lines, up to the first final one."""
    batch = []
    for line in lines:
        batch.append(TokenEvent.from_line(line))
        if batch[-1].final:
            break
    return batch
