"""The worker's engine thread: every engine call happens here, nowhere else. It takes the HTTP
thread's commands, steps the engine, turns outputs into token events and delivers them to the
legs' sinks. Every KV transfer decision is `HandOver`'s (`workers/handover.py`, whose docstring
is the life cycle of PREFILL and DECODE legs' transfers); transfers are polled by `HubPump`'s
thread (so they progress during long steps) and their events are applied here.

Life cycle of a leg (see `legs/protocol.py` for the kinds):
- LOCAL: `add_request`; token events until finished.
- PREFILL: `add_request(hand_over=True)`; a final event carrying token 0 (or ending the
  request, when token 0 ended it); the KV then moves without the leg (`HandOver.send_kv`).
- DECODE: `add_remote_request`; token events from token 0 once the KV arrived, or after a
  local recompute when it never did (the first event says so: `extra.recomputed`).
- cancel (client gone): the leg ends and its engine request is aborted, at once or, with a
  session open, once the session says the blocks are reusable.
- while the worker changes role (`workers/role_flip.py`), a submitted leg is refused at once.
  A router's running LOCAL or DECODE leg on a worker becoming a prefill worker is handed back:
  its final event says `extra.moved` (no error) and its engine request is parked, blocks held
  (`workers/parked.py`); the router continues the request on a decode worker, and its resumed
  PREFILL leg here sends the parked KV as it is, token 0 being the next token the stream had
  (`Engine.hand_over_parked`), so nothing is computed twice and the tokens are those of the
  undisturbed run. Unclaimed, the parked request is released after `PARK_S`. A router's
  DECODE leg still waiting for its KV is handed back as soon as such a flip begins, before
  any token (`HandOver.hand_back`); the router starts it over elsewhere.

Invariant: a leg's blocks return to the pool on every path: finish, cancel, transfer failure,
peer death (the sessions' leases bound every wait).

Threading: `submit`, `submit_to`, `cancel`, `change_role` and `pin` are called from the HTTP
thread and only enqueue commands (`workers/loop_commands.py`); results go back through
`loop.call_soon_threadsafe`, batched once per iteration, and are put into the legs' sinks
there, in the order they were emitted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pdserve.api.errors import ApiError
from pdserve.common.engine_options import Role
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.parallel.rank_group import RankFailed
from pdserve.legs.protocol import MOVED, LegKind, LegRequest, TokenEvent
from pdserve.throttled_log import ThrottledLog
from pdserve.workers.cpu_pin import PinDone, pin_process
from pdserve.workers.handover import (
    HandOver,
    LegDropped,
    LegEnded,
    LegHandedBack,
    LegRecomputing,
    Outcome,
)
from pdserve.workers.hub_pump import HubPump
from pdserve.workers.loop_commands import (
    Cancel,
    Command,
    Flip,
    Pin,
    Reply,
    Sink,
    Stop,
    Submit,
)
from pdserve.workers.parked import ParkedLegs
from pdserve.workers.prefill_budget import Pacer
from pdserve.workers.role_flip import RoleFlip
from pdserve.workers.step_trace import Step, StepTrace
from pdserve.workers.worker_metrics import WorkerMetrics

log = logging.getLogger("pdserve.worker")

# A refusal's extra key: this worker cannot take legs now, another may (the request is fine).
UNAVAILABLE = "unavailable"
IDLE_WAIT_S = 0.05  # nothing to do: wait this long for a command
POLL_WAIT_S = 0.001  # transfers in flight, nothing to compute
RANK_CHECK_S = 0.5  # an idle worker finds a dead tensor-parallel rank within this
PAST_TARGET_LOG_S = 60.0  # a TPOT target no step meets: said once a minute while it lasts


@dataclass
class Accepted:
    """The first item of every leg's queue when the engine took it."""


class QueueSink(asyncio.Queue):
    """A leg's items, for a reader that awaits them (`EngineLoop.events`)."""

    def delivered(self) -> None:
        """Nothing to do: `put_nowait` already woke the reader."""


class LegRefused(Exception):
    """The engine refused a leg (its message says why); it holds nothing for it.
    `unavailable`: this worker cannot take legs now (another may), not the leg's fault."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


@dataclass(eq=False)
class _Leg:
    req: LegRequest
    sink: Sink
    engine_id: str
    arrived: float  # when the HTTP thread submitted it (a step may run before the engine
    # thread takes it: that wait is the client's too)
    movable: bool = False  # a router's leg: a role change may hand it back (`Submit`)
    cancelled: bool = False
    last_token_at: float | None = None
    recomputed: bool = False  # a decode leg whose KV never came: its first event says so
    sent: tuple[int, int] = (0, 0)  # output tokens and characters in its events so far


class EngineLoop:
    def __init__(self, engine: Engine, pump: HubPump | None, metrics: WorkerMetrics,
                 stream_layers: bool = False, tpot_target_s: float | None = None,
                 itl_target_s: float | None = None, ttft_target_s: float | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        """`tpot_target_s`: local prompts beside decoding streams go in chunks that keep the
        streams' mean time per token within it, and each gap within `itl_target_s` (None: the
        TPOT target), run to that ceiling while a local prompt would otherwise miss
        `ttft_target_s` (`workers/prefill_budget.py`); None: whole prompts. `on_fatal(reason)`:
        called on the engine thread, once, after a failure that leaves the engine unable to
        compute (a tensor-parallel rank died) has failed every leg; the thread then ends."""
        self.engine, self.pump, self.metrics = engine, pump, metrics
        self._on_fatal = on_fatal
        self.pacer = None if tpot_target_s is None else \
            Pacer(tpot_target_s, itl_target_s, engine.config.block_size, ttft_target_s)
        self._warnings = ThrottledLog(log, PAST_TARGET_LOG_S)
        self._ranks_checked_at = 0.0  # when the tensor-parallel ranks were last seen alive
        self.handover = None if pump is None else HandOver(engine, pump.hub, metrics)
        self._stream_layers = stream_layers and pump is not None
        self.trace = StepTrace()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._legs: dict[str, _Leg] = {}  # engine request id -> leg
        self._out: list[tuple[Sink, object]] = []
        self._aio: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.flip = RoleFlip(engine, metrics, pump is not None, self._emit)
        self.parked = ParkedLegs()
        self._arm_layer_hook()

    # -- the HTTP thread's side ----------------------------------------------------------------

    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(Stop())
        self._thread.join(timeout=10)

    def submit(self, req: LegRequest) -> QueueSink:
        """The leg's queue, to read with `events`."""
        sink = QueueSink()
        self.submit_to(req, sink)
        return sink

    def submit_to(self, req: LegRequest, sink: Sink, movable: bool = False) -> None:
        self._commands.put(Submit(req, sink, time.perf_counter(), movable))

    def cancel(self, request_id: str) -> None:
        self._commands.put(Cancel(request_id))

    def change_role(self, role: Role, timeout_s: float) -> asyncio.Future[object]:
        """Change the role once what the worker holds has drained, within `timeout_s`
        (`workers/role_flip.py`). Call on the HTTP thread's running loop; the future gets a
        `FlipDone` or an `ApiError`."""
        reply = Reply(asyncio.get_running_loop().create_future())
        self._commands.put(Flip(Role(role), timeout_s, reply, time.perf_counter()))
        return reply.future

    def pin(self, cpus: tuple[int, ...]) -> asyncio.Future[object]:
        """Compute on `cpus` from the next step on (`workers/cpu_pin.py`). Call on the HTTP
        thread's running loop; the future gets a `PinDone` or an `ApiError`."""
        reply = Reply(asyncio.get_running_loop().create_future())
        self._commands.put(Pin(cpus, reply))
        return reply.future

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
                raise LegRefused(first.error, bool(first.extra.get(UNAVAILABLE)))
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
            except RankFailed as e:  # no step can run again: end the legs, then the worker
                log.critical("the engine cannot compute: %s; failing every leg and stopping "
                             "this worker", e)
                self._fail_all(f"the worker's engine failed: {e}")
                self._flush()
                if self._on_fatal is not None:
                    self._on_fatal(str(e))
                return
            except Exception:  # a bug: fail every leg rather than hang them
                log.exception("engine loop iteration failed; failing every leg")
                self._fail_all("internal error in the engine loop")
            self._flush()

    def _iterate(self) -> None:
        self._take_commands()
        if time.monotonic() >= self._ranks_checked_at + RANK_CHECK_S:
            self._ranks_checked_at = time.monotonic()
            self.engine.check_ranks()
        for engine_id in self.parked.expired():
            self.engine.release(engine_id)
        if self.handover is not None:
            for outcome in self.handover.advance(self.pump.take_events()):
                self._apply(outcome)
        # Refusals and transfer outcomes go out before a long step. Acceptances alone wait for
        # the step's events: delivering them now woke the HTTP thread mid-step on a pinned
        # worker's one core, for nothing a client sees (TTFT -0.06..0.09 ms, trace, 2 cores).
        if not all(isinstance(item, Accepted) for _, item in self._out):
            self._flush()
        if self.engine.has_unfinished_requests():
            t0, wall0 = time.perf_counter(), time.time()
            outputs = self.engine.step()
            seconds = time.perf_counter() - t0
            stats = self.engine.take_step_stats()
            if stats is not None:
                self.metrics.observe_step(seconds)
                step = Step.of(wall0, wall0 + seconds, stats)
                self.trace.record(step)
                if self.pacer is not None:
                    self.pacer.observe(step)
            for out in outputs:
                self._on_output(out)
            self._refresh_prefill_chunk()
        if self.flip.flipping:
            self._advance_flip()

    def _refresh_prefill_chunk(self) -> None:
        if self.pacer is None:
            return
        site = self.engine.chunk_site()
        # read only where a TTFT target asks for it: the waiting prompts, every step
        queue = () if self.pacer.ttft_target_s is None else self.engine.prompt_queue()
        chunk = self.pacer.chunk(self.trace, time.monotonic(), site.streams, site.context,
                                 queue)
        if chunk != self.engine.prefill_chunk:
            self.engine.set_prefill_chunk(chunk)
        if self.pacer.past is not None:
            self._warnings.warn(
                "past-target", "decode steps take %.0f ms (median), at or over the %.0f ms TPOT "
                "target (--slo-tpot-ms): no prefill chunk keeps the streams within it, and "
                "prompts prefilled here advance one block (%d tokens) a step; a larger target, "
                "fewer streams per worker (--max-num-seqs) or more decode workers meet it",
                self.pacer.past * 1e3, self.pacer.tpot_target_s * 1e3,
                self.engine.config.block_size)

    def _advance_flip(self) -> None:
        """Switch once no request moves KV in or out and every leg left runs in the new role;
        becoming a prefill worker, the router's running legs are handed back then (all in the
        iteration that switches, so a leg the router sends for them is not refused)."""
        for engine_id in self.parked.all():  # unclaimed since the last flip: they had time
            self.engine.release(engine_id)
        to_prefill = self.flip.target is Role.PREFILL
        if to_prefill:  # a reservation waits for a prefill that may not have started yet
            for leg in [g for g in self._legs.values() if g.movable and not g.cancelled]:
                if self.handover.hand_back(leg.engine_id):
                    self._end(leg, _moved(leg))
                    self.metrics.handed_back.inc()
        held = self.engine.moves_kv() or (to_prefill and any(
            not leg.movable or leg.cancelled for leg in self._legs.values()))
        if self.flip.advance(holds_work=held):
            self._arm_layer_hook()
            if to_prefill:
                for leg in list(self._legs.values()):
                    self._hand_back(leg)

    def _hand_back(self, leg: _Leg) -> None:
        """End a running leg for the router to continue elsewhere, its request parked (or, if
        it cannot be, still computing its prompt, aborted: its computed blocks stay in the
        prefix cache)."""
        if leg.req.transfer_id is not None:
            self.handover.finished(leg.engine_id)
        if self.engine.park(leg.engine_id):
            self.parked.add(leg.req.request_id, leg.engine_id)
        else:
            self.engine.abort(leg.engine_id)
        self._end(leg, _moved(leg))
        self.metrics.handed_back.inc()

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(
            self.handover and self.handover.sessions_open)

    def _take_commands(self) -> None:
        busy = self._busy()
        timeout = None if busy else IDLE_WAIT_S
        if busy and not self.engine.has_compute_work():
            timeout = POLL_WAIT_S  # only transfers (or KV waits): don't spin
        while True:
            try:
                cmd = self._commands.get(timeout=timeout) if timeout else \
                    self._commands.get_nowait()
            except queue.Empty:
                return
            timeout = None
            match cmd:
                case Submit():
                    self._submit(cmd)
                case Cancel():
                    self._cancel(cmd.request_id)
                case Flip():
                    self.flip.begin(cmd)
                case Pin():
                    self._emit(cmd.reply, self._pin(cmd.cpus))
                case Stop():
                    return

    def _pin(self, cpus: tuple[int, ...]) -> PinDone | ApiError:
        """Compute on `cpus` from the next step on; the pacer prices the steps timed before
        for them (`Pacer.cores_changed`)."""
        done = pin_process(cpus, self.engine.config.tensor_parallel_size)
        if isinstance(done, PinDone) and self.pacer is not None:
            self.pacer.cores_changed(time.time(), done.threads_before, done.threads)
        return done

    def _submit(self, cmd: Submit) -> None:
        req, sink = cmd.req, cmd.sink
        if self.flip.flipping:
            refusal = _error(self.flip.refusal())
            refusal.extra[UNAVAILABLE] = True  # not the request's fault: try another worker
            self._emit(sink, refusal)
            return
        if any(leg.req.request_id == req.request_id for leg in self._legs.values()):
            self._emit(sink, _error(f"request id {req.request_id!r} is already running here"))
            return
        engine_id = self._take_parked(req)
        if engine_id is None:
            try:
                self._add_to_engine(req)
            except ValueError as e:
                self._emit(sink, _error(str(e)))
                return
        leg = _Leg(req, sink, engine_id or req.request_id, cmd.arrived, cmd.movable)
        self._legs[leg.engine_id] = leg
        if req.transfer_id is not None:
            self.handover.expect(req, leg.engine_id)
        self._emit(sink, Accepted())
        self.metrics.legs.inc(kind=req.kind.value)

    def _take_parked(self, req: LegRequest) -> str | None:
        """A resumed PREFILL leg whose parked request holds the KV of its prompt: that request's
        engine id, its KV on the way out as a prefill's (`Engine.hand_over_parked`). None: the
        leg computes its prompt (a parked request that does not fit is released)."""
        if req.resume is None or self.handover is None:
            return None
        engine_id = self.parked.take(req.resume)
        if engine_id is None:
            return None
        try:
            self.engine.hand_over_parked(engine_id, list(req.prompt_token_ids))
        except ValueError as e:
            log.info("leg %s: parked %s not resumed (%s); computing its prompt",
                     req.request_id, req.resume, e)
            self.engine.release(engine_id)
            return None
        return engine_id

    def _add_to_engine(self, req: LegRequest) -> None:
        ids = list(req.prompt_token_ids)
        if req.kind is not LegKind.LOCAL and self.handover is None:
            raise ValueError(f"this worker has no transfer endpoint; it cannot take a "
                             f"{req.kind.value} leg")
        if req.kind is LegKind.DECODE:
            self.engine.add_remote_request(ids, req.params, request_id=req.request_id,
                                           output_offset=req.output_offset)
        else:
            self.engine.add_request(ids, req.params, request_id=req.request_id,
                                    hand_over=req.kind is LegKind.PREFILL,
                                    output_offset=req.output_offset, waited_s=req.waited_s)

    def _arm_layer_hook(self) -> None:
        """Layer-wise sending runs a hook after every layer of every step (on CUDA a stream
        sync each): armed only in the role that hands prompts over."""
        streams = self._stream_layers and self.engine.role is Role.PREFILL
        self.engine.on_layer = self.handover.on_layer if streams else None

    def _cancel(self, request_id: str) -> None:
        leg = next((g for g in self._legs.values() if g.req.request_id == request_id), None)
        if leg is None or leg.cancelled:
            return
        leg.cancelled = True
        if self.handover is not None and self.handover.cancel(leg.engine_id):
            return  # its session's outcome ends the leg
        del self._legs[leg.engine_id]
        self.engine.abort(leg.engine_id)
        self.metrics.cancelled.inc()

    def _apply(self, outcome: Outcome) -> None:
        leg = self._legs.get(outcome.engine_id)
        if leg is None:  # ended already (a failed iteration ended every leg)
            return
        match outcome:
            case LegEnded():
                event = _error(outcome.message)
                if outcome.prefill_finished is not None:
                    event.extra["prefill_finished"] = outcome.prefill_finished
                self._end(leg, event)
            case LegRecomputing():
                del self._legs[leg.engine_id]
                leg.engine_id, leg.recomputed = outcome.new_engine_id, True
                self._legs[leg.engine_id] = leg
            case LegDropped():
                del self._legs[leg.engine_id]
            case LegHandedBack():
                self._end(leg, _moved(leg))

    # -- engine outputs ------------------------------------------------------------------------

    def _on_output(self, out: RequestOutput) -> None:
        leg = self._legs.get(out.request_id)
        if leg is None or leg.cancelled:
            return
        event = self._token_event(leg, out)
        if out.kv_block_ids is not None:  # prefill: token 0 sampled, blocks held
            event.final = True
            self._emit(leg.sink, event)
            del self._legs[leg.engine_id]
            self.handover.send_kv(out)
        elif out.finished:
            if leg.req.transfer_id is not None:
                self.handover.finished(leg.engine_id)
            self.metrics.observe_finished(leg.arrived, out)
            event.final = True
            self._end(leg, event)
        else:
            self._emit(leg.sink, event)

    def _token_event(self, leg: _Leg, out: RequestOutput) -> TokenEvent:
        c = out.outputs[0]
        n_new = len(c.new_token_ids)
        now = time.perf_counter()
        if n_new:
            self.metrics.observe_tokens(leg.arrived, leg.last_token_at, now, n_new)
            leg.last_token_at = now
        first = len(c.token_ids) - n_new
        leg.sent = (len(c.token_ids), len(c.text))
        return TokenEvent(
            index=first, token_ids=list(c.new_token_ids),
            text_offset=len(c.text) - len(c.new_text), text=c.new_text,
            logprobs=c.logprobs[first:] if c.logprobs is not None else None,
            top_logprobs=c.top_logprobs[first:] if c.top_logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason, held_tokens=c.held_tokens,
            prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
            extra={"recomputed": True} if leg.recomputed and first == 0 else {})

    # -- bookkeeping ---------------------------------------------------------------------------

    def _end(self, leg: _Leg, event: TokenEvent) -> None:
        event.final = True
        self._emit(leg.sink, event)
        del self._legs[leg.engine_id]

    def _fail_all(self, reason: str) -> None:
        """After a bug: end every leg. Reserved blocks with an open session are freed only
        when that session says no writer can touch them (the hand-over's usual path)."""
        for engine_id in self.parked.all():
            self.engine.release(engine_id)
        for leg in list(self._legs.values()):
            if self.handover is not None and self.handover.fail(leg.engine_id, reason):
                self._emit(leg.sink, _error(reason))
                del self._legs[leg.engine_id]
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


def _moved(leg: _Leg) -> TokenEvent:
    """The final event of a leg handed back after what it sent."""
    tokens, chars = leg.sent
    return TokenEvent(index=tokens, token_ids=[], text_offset=chars, text="", extra={MOVED: True})


def _error(message: str) -> TokenEvent:
    return TokenEvent(index=0, token_ids=[], text_offset=0, text="", final=True, error=message)
