"""A worker's KV hand-over policy: the scheduler side of its KV connector. `HandOver` decides,
for every leg that moves KV, what the engine reserves, holds, releases and aborts, and what the
transfer hub opens, aborts and closes. The engine loop reports what happened (a leg was taken,
a prefill sampled token 0, a request finished, a leg was cancelled, the hub's events) and
applies the returned outcomes to its legs; it makes no transfer decision itself.

Life cycle of a transfer (one per PREFILL or DECODE leg, by its transfer id, `expect`ed when
the leg is taken):
- PREFILL: the engine computes the prompt (`add_request(hand_over=True)`); with layer
  streaming, each layer of a completing prompt goes to the transfer from the engine's layer
  hook (`on_layer`). At token 0 (`send_kv`) a `SendSession` to the decode peer, and
  `Engine.release` once the session says the blocks are reusable (`SendEnded`), or at once when
  the decode side already gave up. If token 0 ended the request (`finished`), the decode side is
  told (`close_finished`) and its leg ends without a recompute.
- DECODE: `add_remote_request` queued the reservation (until the pool has room: admission
  control); once blocks are reserved, a `RecvSession`; on DONE `kv_ready(token0)` and the leg
  decodes. On a failed transfer (the lease lapsed, the peer died or aborted...) the prompt is
  recomputed at once under a new engine id (`LegRecomputing`), unless the leg was cancelled or
  the prefill side said token 0 already ended the request (`LegEnded`). The reserved request is
  aborted (its blocks freed) once no writer can touch them, which for a stalled sender (alive,
  silent) is when it wakes and confirms its fence, or dies (`RecvBlocksFree`): the client never
  waits for that.
- cancel (client gone): an open session is aborted, and its outcome ends the leg once the
  session says the blocks are reusable (`LegEnded` or `LegDropped`); a transfer with no session
  yet is closed at once (streamed writes fenced first) and the peer told, so it never waits out
  a lease, and the caller aborts the engine request.
- hand-back (this worker becomes a prefill worker, `workers/role_flip.py`): a DECODE leg whose
  KV has not come is given up as a cancel is (`hand_back`), but the caller ends the leg at
  once, handed back, and the peer is told why (`HANDED_BACK`): its prefill, queued or
  computing, stops there, and its PREFILL leg ends handed back too (`LegHandedBack`), no
  error. The router continues the request from where these legs began, with another decode
  worker. The reservation's blocks are freed as a cancel's are: at once with no session, else
  once no writer can touch them (a round trip to a live sender), which the flip waits for.
- peer death or restart: a leg naming a peer instance this worker knows dead (the router's
  view lags a restart by up to a health check) ends at once, before any compute: a PREFILL leg
  with an error, a DECODE leg by recomputing locally. A peer that dies or restarts later
  (`PeerDead` for a transfer with no session yet; its session's failure otherwise) frees what
  is held for it at once: the prefill's blocks, the decode's reservation (a dead writer writes
  no more), with no lease to wait out.

Invariant: every engine request of a transfer returns its blocks to the pool on every path:
finish, cancel, transfer failure, peer death (the sessions' leases bound every wait for a
peer that is alive but silent; the hub's HOLDs keep them from running out while a transfer
only waits for its prompt's compute or its reservation's room, `transfer_hub.py`).
Threading: the engine thread alone calls every method (`on_layer` from inside a step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.legs.protocol import LegKind, LegRequest
from pdserve.workers.transfer_hub import (
    HubEvent,
    PeerClosed,
    PeerDead,
    RecvBlocksFree,
    RecvDone,
    RecvFailed,
    SendEnded,
    TransferHub,
)
from pdserve.workers.worker_metrics import WorkerMetrics

log = logging.getLogger("pdserve.worker")

CLIENT_GONE = "the client went away"
CANCELLED = "the request was cancelled"
# Why a decode worker gave a transfer up, as its ABORT says it (the sender finds it in the
# reason it gets, which a receiving session prefixes).
HANDED_BACK = "the decode worker handed the request back (it changes role)"


@dataclass(frozen=True)
class LegEnded:
    """The transfer ended the leg: its final event is an error saying `message`."""

    engine_id: str
    message: str
    prefill_finished: bool | None = None  # a decode leg: token 0 ended it at the prefill side


@dataclass(frozen=True)
class LegRecomputing:
    """The KV never came: the leg runs on as the local engine request `new_engine_id`."""

    engine_id: str
    new_engine_id: str


@dataclass(frozen=True)
class LegDropped:
    """A cancelled leg's KV arrived anyway: its request is aborted; the leg ends silently."""

    engine_id: str


@dataclass(frozen=True)
class LegHandedBack:
    """The decode side handed the request back before its KV moved: this PREFILL leg's
    request was aborted, and the leg ends handed back (`extra.moved`), no error."""

    engine_id: str


Outcome = LegEnded | LegRecomputing | LegDropped | LegHandedBack


class _Stage(IntEnum):
    QUEUED = 0  # no session yet: the prompt computes, or the reservation waits for room
    TRANSFERRING = 1  # a session is open


@dataclass(eq=False)
class _Transfer:
    """One leg's transfer and its engine request: the leg's request id, or the parked request
    a resumed PREFILL leg sends (a recompute runs under another id, and its transfer is
    forgotten then)."""

    req: LegRequest
    engine_id: str
    stage: _Stage = _Stage.QUEUED
    cancelled: bool = False


class HandOver:
    def __init__(self, engine: Engine, hub: TransferHub, metrics: WorkerMetrics,
                 stream_layers: bool = False) -> None:
        self.engine, self.hub, self.metrics = engine, hub, metrics
        if stream_layers:
            engine.on_layer = self.on_layer
        self._by_tid: dict[int, _Transfer] = {}
        self._by_engine_id: dict[str, _Transfer] = {}
        # transfer id -> engine request still holding the reserved blocks of a failed transfer
        # whose writer is not known quiet (aborted on RecvBlocksFree)
        self._held: dict[int, str] = {}
        self._early: list[Outcome] = []  # decided while taking a leg; returned by `advance`

    @property
    def sessions_open(self) -> bool:
        return bool(self.hub.active)

    def expect(self, req: LegRequest, engine_id: str | None = None) -> None:
        """The engine took `req` (a PREFILL or DECODE leg) under its request id, or under
        `engine_id` (a parked request). If its peer is known dead, the leg's outcome is decided
        now (its engine request aborted, or recomputing) and comes with the next `advance`,
        before the engine steps."""
        t = _Transfer(req, engine_id or req.request_id)
        self._by_tid[req.transfer_id] = t
        self._by_engine_id[t.engine_id] = t
        dead = self.hub.expect(req.transfer_id, req.peer)
        if dead is not None:
            self._early.append(self._peer_dead(t, dead))

    def advance(self, events: Iterable[HubEvent]) -> list[Outcome]:
        """Apply the hub's events, then open a session for every reservation that got its
        blocks. The outcomes are for legs the caller may have ended already (ignore those)."""
        outcomes, self._early = self._early, []
        outcomes += [o for e in events if (o := self._on_event(e)) is not None]
        self._open_reservations()
        return outcomes

    def send_kv(self, out: RequestOutput) -> None:
        """A prefill sampled token 0 and `out.kv_block_ids` hold its KV: send them."""
        t = self._by_engine_id[out.request_id]
        c = out.outputs[0]
        if not self.hub.open_send(t.req.transfer_id, t.req.peer, out.kv_block_ids,
                                  c.token_ids[0], c.logprobs[0] if c.logprobs else None):
            self.engine.release(t.engine_id)  # the decode side gave up while we computed
            self._forget(t)
            return
        t.stage = _Stage.TRANSFERRING

    def finished(self, engine_id: str) -> None:
        """The engine finished request `engine_id` (a prefill whose token 0 ended it, or a
        decode that ran to its end)."""
        t = self._by_engine_id.get(engine_id)
        if t is None:
            return
        if t.req.kind is LegKind.PREFILL:
            self.hub.close_finished(t.req.transfer_id, t.req.peer)
        self._forget(t)

    def cancel(self, engine_id: str) -> bool:
        """The leg's consumer went away. True: its session is being aborted and an outcome
        ends the leg once the blocks are reusable. False: the caller aborts the engine request
        now (a transfer not yet open is closed first, and the peer told)."""
        return self._end_early(engine_id, CLIENT_GONE, CANCELLED)

    def hand_back(self, engine_id: str) -> bool:
        """Give up the KV of DECODE leg `engine_id` if it has not come (see the module
        docstring); True: the caller ends the leg now, handed back (its reservation is freed
        here, at once or once no writer can touch it; any outcome for it comes for a leg
        already ended). False: no such leg (its KV came, or it recomputes), nothing done."""
        t = self._by_engine_id.get(engine_id)
        if t is None or t.req.kind is not LegKind.DECODE or t.cancelled:
            return False
        if not self._end_early(engine_id, HANDED_BACK, HANDED_BACK):
            self.engine.abort(engine_id)
        return True

    def fail(self, engine_id: str, reason: str) -> bool:
        """The loop ends the leg after a bug. True: as for `cancel`, its session is being
        aborted (the outcome comes for a leg already ended). False: the caller aborts the
        engine request now."""
        return self._end_early(engine_id, reason, None)

    def on_layer(self, layer: int, batch: SchedulerOutput) -> None:
        """Engine hook, inside a step: layer `layer` of every prompt this step completes is
        in the pool; hand it to the transfer (layer i on the wire while layer i+1 computes)."""
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if not req.hand_over or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            t = self._by_engine_id.get(req.request_id)
            if t is None or t.cancelled:
                continue
            self.hub.stream_layers(t.req.transfer_id, t.req.peer, req.block_ids, layer + 1)
            self.metrics.layers_streamed.inc()

    # -- the hub's events ----------------------------------------------------------------------

    def _on_event(self, event: HubEvent) -> Outcome | None:
        if isinstance(event, RecvBlocksFree):  # the leg may be long gone
            held = self._held.pop(event.transfer_id, None)
            if held is not None:
                self.engine.abort(held)
            return None
        t = self._by_tid.get(event.transfer_id)
        if t is None:
            return None
        if isinstance(event, SendEnded):
            self.engine.release(t.engine_id)
            self._forget(t)
            self.metrics.observe_transfer(event.ok, event.seconds, event.nbytes, "send")
            return None
        if isinstance(event, RecvDone):
            return self._received(t, event)
        if isinstance(event, RecvFailed):
            self.metrics.observe_transfer(False, 0.0, 0, "recv")
            if event.blocks_free:
                self.engine.abort(t.engine_id)
            else:  # a writer may still land bytes: hold the blocks, recompute in others
                self._held[event.transfer_id] = t.engine_id
            return self._after_failure(t, event.reason, event.sender_finished)
        if isinstance(event, PeerDead):
            return self._peer_dead(t, event.reason)
        return self._peer_closed(t, event)

    def _received(self, t: _Transfer, event: RecvDone) -> Outcome | None:
        self.metrics.observe_transfer(True, event.seconds, event.nbytes, "recv")
        self._forget(t)
        if t.cancelled:
            self.engine.abort(t.engine_id)
            return LegDropped(t.engine_id)
        self.engine.kv_ready(t.engine_id, event.token0, event.token0_logprob)
        return None

    def _peer_closed(self, t: _Transfer, event: PeerClosed) -> Outcome:
        self.engine.abort(t.engine_id)
        if t.req.kind is LegKind.PREFILL:
            self._forget(t)
            if HANDED_BACK in event.reason:
                return LegHandedBack(t.engine_id)
            return LegEnded(t.engine_id, f"the decode side closed the transfer: {event.reason}")
        return self._after_failure(t, event.reason, event.finished)

    def _peer_dead(self, t: _Transfer, reason: str) -> Outcome:
        """No session yet and the peer is gone: no writer knows the reservation, and no reader
        the prompt. The engine request goes (its compute with it); a decode leg recomputes."""
        self.engine.abort(t.engine_id)
        if t.req.kind is LegKind.PREFILL:
            self._forget(t)
            return LegEnded(t.engine_id, f"no KV can move to the decode worker: {reason}")
        return self._after_failure(t, reason, False)

    def _after_failure(self, t: _Transfer, reason: str, sender_finished: bool) -> Outcome:
        """Decode leg: end it (cancelled, or token 0 finished it at the prefill) or recompute
        the prompt locally under a new engine id."""
        self._forget(t)
        if t.cancelled or sender_finished:
            return LegEnded(t.engine_id, "the prefill side ended the request at token 0"
                            if sender_finished else "cancelled", prefill_finished=sender_finished)
        log.warning("request %s: KV transfer failed (%s); recomputing the prompt locally",
                    t.req.request_id, reason)
        self.metrics.recomputes.inc()
        new_id = f"{t.req.request_id}/recompute"
        try:
            self.engine.add_request(list(t.req.prompt_token_ids), t.req.params,
                                    request_id=new_id, hand_over=False)
        except ValueError as e:
            return LegEnded(t.engine_id, f"local recompute failed: {e}")
        return LegRecomputing(t.engine_id, new_id)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _open_reservations(self) -> None:
        self.engine.reserve_remote()  # blocks may have been freed since the last step
        for t in self._by_tid.values():
            if t.req.kind is not LegKind.DECODE or t.stage is not _Stage.QUEUED:
                continue
            blocks = self.engine.reserved_blocks(t.engine_id)
            if blocks is not None:
                self.hub.open_recv(t.req.transfer_id, t.req.peer, blocks)
                t.stage = _Stage.TRANSFERRING

    def _end_early(self, engine_id: str, session_reason: str, close_reason: str | None
                   ) -> bool:
        t = self._by_engine_id.get(engine_id)
        if t is None:
            return False
        t.cancelled = True
        if t.stage is _Stage.TRANSFERRING:
            self.hub.abort(t.req.transfer_id, session_reason)  # blocks freed once reusable
            return True
        self._forget(t)
        if close_reason is not None:  # fences streamed writes before the engine frees blocks
            self.hub.close(t.req.transfer_id, t.req.peer, close_reason)
        return False

    def _forget(self, t: _Transfer) -> None:
        self._by_tid.pop(t.req.transfer_id, None)
        self._by_engine_id.pop(t.engine_id, None)
