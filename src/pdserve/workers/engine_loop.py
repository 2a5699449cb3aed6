"""The worker's engine thread: every engine call happens here, nowhere else. Transfers are
polled by `HubPump`'s thread (so they progress during long steps); their events are applied
here.

Life cycle of a leg (see `legs/protocol.py` for the kinds):
- LOCAL: `add_request`; token events until finished.
- PREFILL: `add_request(hand_over=True)`, the transfer id `expect`ed. At token 0: if token 0
  ended the request, a final event and the decode side is told (`close_finished`); else a
  final event carrying token 0, a `SendSession` to the decode peer, and `Engine.release` once
  the session says the blocks are reusable.
- DECODE: `add_remote_request` (queued until the pool has room: admission control); once
  blocks are reserved, a `RecvSession`; on DONE `kv_ready(token0)` and token events until
  finished. On a failed transfer (the lease lapsed, the peer died or aborted...) the prompt
  is recomputed at once under a new engine id, unless the prefill side said token 0 already
  ended the request; the reserved request is aborted (its blocks freed) once no writer can
  touch them, which for a stalled sender (alive, silent) is when it wakes and confirms its
  fence, or dies: the client never waits for that.
- cancel (client gone): an open session is aborted and its blocks freed when reusable; a
  queued request is aborted at once and the peer told, so it never waits out a lease.

Invariant: a leg's blocks return to the pool on every path: finish, cancel, transfer failure,
peer death (the sessions' leases bound every wait).

Threading: `submit`, `submit_to` and `cancel` are called from the HTTP thread and only enqueue
commands; results go back through `loop.call_soon_threadsafe`, batched once per iteration, and
are put into the legs' sinks there, in the order they were emitted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.legs.protocol import LegKind, LegRequest, TokenEvent
from pdserve.workers.hub_pump import HubPump
from pdserve.workers.step_trace import Step, StepTrace
from pdserve.workers.transfer_hub import (
    PeerClosed,
    RecvBlocksFree,
    RecvDone,
    RecvFailed,
    SendEnded,
)
from pdserve.workers.worker_metrics import WorkerMetrics

log = logging.getLogger("pdserve.worker")

IDLE_WAIT_S = 0.05  # nothing to do: wait this long for a command
POLL_WAIT_S = 0.001  # transfers in flight, nothing to compute


class Phase(IntEnum):
    QUEUED = 0  # in the engine, before token 0 (or before the reservation, on decode)
    TRANSFERRING = 1  # a session is open
    RUNNING = 2  # decoding (decode leg after kv_ready, or a local leg)
    DONE = 3


@dataclass
class Accepted:
    """The first item of every leg's queue when the engine took it."""


class Sink(Protocol):
    """Where a leg's items go, on the HTTP thread: a `QueueSink` (read by `events`), or a leg
    channel's own sink. Items: `Accepted` or a final error `TokenEvent` first, then events,
    the last one final. One delivery puts the items of one engine-loop iteration, then calls
    `delivered` once on each sink it put into: a sink that sends sends then, in the same turn
    of the HTTP thread's loop."""

    def put_nowait(self, item: object) -> None: ...

    def delivered(self) -> None: ...


class QueueSink(asyncio.Queue):
    """A leg's items, for a reader that awaits them (`EngineLoop.events`)."""

    def delivered(self) -> None:
        """Nothing to do: `put_nowait` already woke the reader."""


class LegRefused(Exception):
    """The engine refused a leg (its message says why); it holds nothing for it."""


@dataclass(eq=False)
class _Leg:
    req: LegRequest
    sink: Sink
    engine_id: str
    arrived: float  # when the HTTP thread submitted it (a step may run before the engine
    # thread takes it: that wait is the client's too)
    phase: Phase = Phase.QUEUED
    cancelled: bool = False
    last_token_at: float | None = None
    recomputed: bool = False  # a decode leg whose KV never came: its first event says so


class EngineLoop:
    def __init__(self, engine: Engine, hub: HubPump | None, metrics: WorkerMetrics,
                 stream_layers: bool = False) -> None:
        self.engine, self.hub, self.metrics = engine, hub, metrics
        if stream_layers and hub is not None:
            engine.on_layer = self._stream_layer
        self.trace = StepTrace()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._legs: dict[str, _Leg] = {}  # engine request id -> leg
        self._by_tid: dict[int, _Leg] = {}
        # transfer id -> engine request still holding the reserved blocks of a failed transfer
        # whose writer is not known quiet (freed on RecvBlocksFree)
        self._held: dict[int, str] = {}
        self._out: list[tuple[Sink, object]] = []
        self._aio: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- the HTTP thread's side ----------------------------------------------------------------

    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    def submit(self, req: LegRequest) -> QueueSink:
        """The leg's queue, to read with `events`."""
        sink = QueueSink()
        self.submit_to(req, sink)
        return sink

    def submit_to(self, req: LegRequest, sink: Sink) -> None:
        self._commands.put(("submit", req, sink, time.perf_counter()))

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id, None, 0.0))

    async def events(self, request_id: str, sink: QueueSink
                     ) -> AsyncIterator[list[TokenEvent]]:
        """A submitted leg's events, those queued together as one list, up to its final one.
        Raises LegRefused if the engine refused it. Closed or cancelled before the final event
        (the consumer went away), it cancels the leg, which frees its blocks; that includes
        while it waits for the acceptance, which comes with the leg's first events (the whole
        first step, seconds for a long prompt)."""
        finished = False
        try:
            first = await sink.get()
            if not isinstance(first, Accepted):
                finished = True  # refused: the engine holds nothing for it
                raise LegRefused(first.error)
            while not finished:
                events = await _ready_events(sink)
                finished = any(e.final for e in events)
                yield events
        finally:
            if not finished:
                self.cancel(request_id)

    @property
    def num_legs(self) -> int:
        return len(self._legs)

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:  # a bug: fail every leg rather than hang them
                log.exception("engine loop iteration failed; failing every leg")
                self._fail_all("internal error in the engine loop")
            self._flush()

    def _iterate(self) -> None:
        self._take_commands()
        if self.hub is not None:
            for event in self.hub.take_events():
                self._on_transfer(event)
        self._open_reservations()
        # Refusals and transfer outcomes go out before a long step. Acceptances alone wait for
        # the step's events: delivering them now woke the HTTP thread mid-step on a pinned
        # worker's one core, for nothing a client sees (TTFT -0.06..0.09 ms, trace, 2 cores).
        if not all(isinstance(item, Accepted) for _, item in self._out):
            self._flush()
        if self.engine.has_unfinished_requests():
            t0, wall0 = time.perf_counter(), time.time()
            outputs = self.engine.step()
            seconds = time.perf_counter() - t0
            if self.engine.last_batch[2]:
                self.metrics.observe_step(seconds)
                self.trace.record(Step(wall0, wall0 + seconds, *self.engine.last_batch))
                self.engine.last_batch = (0, 0, 0, 0)
            for out in outputs:
                self._on_output(out)

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self.hub and self.hub.active)

    def _take_commands(self) -> None:
        timeout = None if self._busy() else IDLE_WAIT_S
        if self._busy() and not self.engine.scheduler.running and not self.engine.scheduler.waiting:
            timeout = POLL_WAIT_S  # only transfers (or KV waits): don't spin
        while True:
            try:
                cmd = self._commands.get(timeout=timeout) if timeout else \
                    self._commands.get_nowait()
            except queue.Empty:
                return
            timeout = None
            if cmd is None:
                return
            op, arg, sink, at = cmd
            if op == "submit":
                self._submit(arg, sink, at)
            else:
                self._cancel(arg)

    def _submit(self, req: LegRequest, sink: Sink, arrived: float) -> None:
        if any(leg.req.request_id == req.request_id for leg in self._legs.values()):
            self._emit(sink, _error(f"request id {req.request_id!r} is already running here"))
            return
        try:
            self._add_to_engine(req, req.request_id)
        except ValueError as e:
            self._emit(sink, _error(str(e)))
            return
        leg = _Leg(req, sink, req.request_id, arrived)
        self._legs[leg.engine_id] = leg
        if req.transfer_id is not None:
            self._by_tid[req.transfer_id] = leg
            self.hub.expect(req.transfer_id)
        self._emit(sink, Accepted())
        self.metrics.legs.inc(kind=req.kind.value)

    def _add_to_engine(self, req: LegRequest, engine_id: str) -> None:
        ids = list(req.prompt_token_ids)
        if req.kind is LegKind.DECODE:
            if self.hub is None:
                raise ValueError("this worker has no transfer endpoint; it cannot take a "
                                 "decode leg")
            self.engine.add_remote_request(ids, req.params, request_id=engine_id)
        else:
            if req.kind is LegKind.PREFILL and self.hub is None:
                raise ValueError("this worker has no transfer endpoint; it cannot take a "
                                 "prefill leg")
            self.engine.add_request(ids, req.params, request_id=engine_id,
                                    hand_over=req.kind is LegKind.PREFILL)

    def _cancel(self, request_id: str) -> None:
        leg = next((g for g in self._legs.values() if g.req.request_id == request_id), None)
        if leg is None or leg.cancelled:
            return
        leg.cancelled = True
        tid = leg.req.transfer_id
        if leg.phase is Phase.TRANSFERRING:
            self.hub.abort(tid, "the client went away")  # blocks freed once reusable
            return
        self._drop(leg)
        if tid is not None and leg.phase is Phase.QUEUED:  # fences streamed writes first
            self.hub.close(tid, leg.req.peer, "the request was cancelled")
        self.engine.abort(leg.engine_id)
        self.metrics.cancelled.inc()

    # -- transfers -----------------------------------------------------------------------------

    def _open_reservations(self) -> None:
        if self.engine.scheduler.waiting_for_kv:
            self.engine.scheduler.reserve_remote()  # blocks may have been freed since
        for leg in list(self._by_tid.values()):
            if leg.req.kind is not LegKind.DECODE or leg.phase is not Phase.QUEUED:
                continue
            if leg.engine_id != leg.req.request_id:
                continue  # recomputing locally
            blocks = self.engine.reserved_blocks(leg.engine_id)
            if blocks is not None:
                self.hub.open_recv(leg.req.transfer_id, leg.req.peer, blocks)
                leg.phase = Phase.TRANSFERRING

    def _on_transfer(self, event) -> None:
        if isinstance(event, RecvBlocksFree):  # the leg may be long gone
            held = self._held.pop(event.transfer_id, None)
            if held is not None:
                self.engine.abort(held)
            return
        leg = self._by_tid.get(event.transfer_id)
        if leg is None:
            return
        if isinstance(event, SendEnded):
            self.engine.release(leg.engine_id)
            self._forget(leg)
            self.metrics.observe_transfer(event.ok, event.seconds, event.nbytes, "send")
        elif isinstance(event, RecvDone):
            self.metrics.observe_transfer(True, event.seconds, event.nbytes, "recv")
            if leg.cancelled:
                self.engine.abort(leg.engine_id)
                self._forget(leg)
            else:
                leg.phase = Phase.RUNNING
                self.engine.kv_ready(leg.engine_id, event.token0, event.token0_logprob)
        elif isinstance(event, RecvFailed):
            self.metrics.observe_transfer(False, 0.0, 0, "recv")
            if event.blocks_free:
                self.engine.abort(leg.engine_id)
            else:  # a writer may still land bytes: hold the blocks, recompute in others
                self._held[event.transfer_id] = leg.engine_id
            self._after_failed_transfer(leg, event.reason, event.sender_finished)
        elif isinstance(event, PeerClosed):
            self.engine.abort(leg.engine_id)
            if leg.req.kind is LegKind.PREFILL:
                self._end(leg, _error(f"the decode side closed the transfer: {event.reason}"))
            else:
                self._after_failed_transfer(leg, event.reason, event.finished)

    def _after_failed_transfer(self, leg: _Leg, reason: str, sender_finished: bool) -> None:
        """Decode leg: end it (cancelled, or token 0 finished it at the prefill) or recompute."""
        if leg.cancelled or sender_finished:
            event = _error("the prefill side ended the request at token 0"
                           if sender_finished else "cancelled")
            event.extra["prefill_finished"] = sender_finished
            self._end(leg, event)
            return
        log.warning("request %s: KV transfer failed (%s); recomputing the prompt locally",
                    leg.req.request_id, reason)
        self.metrics.recomputes.inc()
        del self._legs[leg.engine_id]
        leg.engine_id = f"{leg.req.request_id}/recompute"
        leg.phase = Phase.RUNNING
        leg.recomputed = True
        self._legs[leg.engine_id] = leg
        try:
            self._add_to_engine(LegRequest(leg.req.request_id, leg.req.prompt_token_ids,
                                           leg.req.params), leg.engine_id)
        except ValueError as e:
            self._end(leg, _error(f"local recompute failed: {e}"))

    # -- engine outputs ------------------------------------------------------------------------

    def _on_output(self, out: RequestOutput) -> None:
        leg = self._legs.get(out.request_id)
        if leg is None or leg.cancelled:
            return
        event = self._token_event(leg, out)
        if out.kv_block_ids is not None:  # prefill: token 0 sampled, blocks held
            event.final = True
            self._emit(leg.sink, event)
            self._hand_over(leg, out)
        elif out.finished:
            if leg.req.kind is LegKind.PREFILL:
                self.hub.close_finished(leg.req.transfer_id, leg.req.peer)
            self.metrics.observe_finished(leg.arrived, out)
            event.final = True
            self._end(leg, event)
        else:
            if leg.req.kind is LegKind.LOCAL:
                leg.phase = Phase.RUNNING
            self._emit(leg.sink, event)

    def _hand_over(self, leg: _Leg, out: RequestOutput) -> None:
        tid = leg.req.transfer_id
        self._drop(leg, keep_tid=True)
        c = out.outputs[0]
        if not self.hub.open_send(tid, leg.req.peer, out.kv_block_ids, c.token_ids[0],
                                  c.logprobs[0] if c.logprobs else None):
            self.engine.release(leg.engine_id)  # the decode side gave up while we computed
            self._forget(leg)
            return
        leg.phase = Phase.TRANSFERRING

    def _stream_layer(self, layer: int, batch: SchedulerOutput) -> None:
        """Engine hook, inside a step: layer `layer` of every prompt this step completes is
        in the pool; hand it to the transfer (layer i on the wire while layer i+1 computes)."""
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if not req.hand_over or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            leg = self._legs.get(req.request_id)
            if leg is None or leg.cancelled or leg.req.transfer_id is None:
                continue
            self.hub.stream_layers(leg.req.transfer_id, leg.req.peer, req.block_ids, layer + 1)
            self.metrics.layers_streamed.inc()

    def _token_event(self, leg: _Leg, out: RequestOutput) -> TokenEvent:
        c = out.outputs[0]
        n_new = len(c.new_token_ids)
        now = time.perf_counter()
        if n_new:
            self.metrics.observe_tokens(leg.arrived, leg.last_token_at, now, n_new)
            leg.last_token_at = now
        first = len(c.token_ids) - n_new
        return TokenEvent(
            index=first, token_ids=list(c.new_token_ids),
            text_offset=len(c.text) - len(c.new_text), text=c.new_text,
            logprobs=c.logprobs[first:] if c.logprobs is not None else None,
            top_logprobs=c.top_logprobs[first:] if c.top_logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
            extra={"recomputed": True} if leg.recomputed and first == 0 else {})

    # -- bookkeeping ---------------------------------------------------------------------------

    def _end(self, leg: _Leg, event: TokenEvent) -> None:
        event.final = True
        self._emit(leg.sink, event)
        self._forget(leg)

    def _drop(self, leg: _Leg, keep_tid: bool = False) -> None:
        """The leg no longer streams; with keep_tid its transfer is still tracked."""
        self._legs.pop(leg.engine_id, None)
        if not keep_tid and leg.req.transfer_id is not None:
            self._by_tid.pop(leg.req.transfer_id, None)

    def _forget(self, leg: _Leg) -> None:
        leg.phase = Phase.DONE
        self._drop(leg)

    def _fail_all(self, reason: str) -> None:
        """After a bug: end every leg. Reserved blocks with an open session are freed only
        when that session says no writer can touch them (the normal RecvFailed path)."""
        for leg in list(self._legs.values()):
            if leg.phase is Phase.TRANSFERRING:
                leg.cancelled = True
                self.hub.abort(leg.req.transfer_id, reason)
                self._emit(leg.sink, _error(reason))
                self._drop(leg, keep_tid=True)  # its transfer event frees the blocks
            else:
                self.engine.abort(leg.engine_id)
                self._end(leg, _error(reason))

    def _emit(self, sink: Sink, item: object) -> None:
        self._out.append((sink, item))

    def _flush(self) -> None:
        if self._out and self._aio is not None:
            batch, self._out = self._out, []
            self._aio.call_soon_threadsafe(_deliver, batch)


async def _ready_events(sink: QueueSink) -> list[TokenEvent]:
    """The next event of a leg's queue and every one already queued behind it (they are sent
    together)."""
    events = [await sink.get()]
    while not sink.empty():
        events.append(sink.get_nowait())
    return events


def _deliver(batch: list[tuple[Sink, object]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
    for sink in dict.fromkeys(sink for sink, _ in batch):
        sink.delivered()


def _error(message: str) -> TokenEvent:
    return TokenEvent(index=0, token_ids=[], text_offset=0, text="", final=True, error=message)
