"""All the KV transfers of one worker: its sessions, and the messages no session owns.

Life cycle of a transfer id here. A leg announces it with `expect(tid)` before any session
exists (the prefill is still computing, or the decode pool has no room yet). Then exactly one
of: `open_send` / `open_recv` (a session runs until terminal; `poll` reports it once; a
failed receive whose writer may still write is reported at once and polled on until the
writer is quiet, then reported again as `RecvBlocksFree`), or
`close(tid, peer, reason)` (this side will never move KV for it: token 0 ended the request,
or the leg was cancelled; the peer is told with an ABORT). Either way the id then stays
"closed" for `CLOSED_MEMORY_S`: any late message for it is answered (an ABORT gets ABORT_ACK,
anything else an ABORT), so a peer never waits out its lease for a transfer that is gone.

Messages for an id that was neither expected nor closed wait in the inbox (a reservation may
arrive before the prefill finished); an ABORT among them closes the id and is reported as
`PeerClosed` when the id is expected, so the leg waiting for it ends at once; the peer's HOLDs
alone are dropped (nothing here waits on a lease yet). Unclaimed messages are dropped after
the lease.

Holding. While this side holds an id without moving its KV yet (expected: the prompt is queued
or computing, or the reservation waits for pool room; or a streamed send whose prompt still
computes), `poll` sends the peer a HOLD every `lease_s / 3`, and the peer's session renews its
lease on each. So a lease times a peer's silence, not the queue ahead of its transfer: the
leases start, in effect, when the transfer can start. A third of the lease lets two HOLDs in a
row come late (a starved pump thread, a busy link) before a waiting peer gives up, and costs
three small messages per lease per waiting transfer. The HOLDs come from `HubPump`'s thread,
never the engine's, so a long engine step does not stop them; a peer that dies, stalls (SIGSTOP)
or loses its pump stops sending them, and the lease ends the wait one lease after the last one.

Peers that restart. `expect` names the peer instance the router paired the leg with and
reaches it at once (`Transport.reach`: the TCP transport dials it), so the first authenticated
contact with a restarted peer's new instance happens when a leg names it, not when the first
KV must move: the old instance is dead from then on, and every session with it fails on the
next poll with its blocks free (a `SendEnded`, or a `RecvFailed` with `blocks_free`). A peer
already known dead is refused at `expect` (the id is closed; the caller ends or recomputes the
leg before any compute), and one that dies while its id is still expected (no session yet) is
reported as `PeerDead` on the next poll. No transfer waits out its lease for a dead peer.

Threading: every public method holds the hub's lock while it runs, so the engine thread (which
opens, aborts and closes transfers) and `HubPump`'s thread (which polls) may both call it; the
sessions and the inbox see one caller at a time.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import (
    FINISHED_AT_TOKEN0,
    MAX_REASON_CHARS,
    ControlMessage,
    ControlOp,
)
from pdserve.transfer.peer import PeerId
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.state import TransferState
from pdserve.transfer.transport import Transport

CLOSED_MEMORY_S = 120.0


@dataclass(frozen=True)
class RecvDone:
    """The KV is in the reserved blocks and verified; decode continues from token 0."""

    transfer_id: int
    token0: int
    token0_logprob: float | None
    seconds: float
    nbytes: int


@dataclass(frozen=True)
class RecvFailed:
    """The transfer failed: the leg recomputes (or ends) now. With `blocks_free` no writer can
    touch the reserved blocks any more; else they stay held (a writer may still land bytes in
    them: a stalled sender, alive but silent) until `RecvBlocksFree` for the same id."""

    transfer_id: int
    reason: str
    sender_finished: bool  # token 0 ended the request at the sender: end the leg, no recompute
    blocks_free: bool = True


@dataclass(frozen=True)
class RecvBlocksFree:
    """The reserved blocks of a failed transfer (`RecvFailed` without `blocks_free`) are quiet
    now: the writer confirmed its fence, or it is known dead."""

    transfer_id: int


@dataclass(frozen=True)
class SendEnded:
    """The sender's blocks are no longer needed by anyone (DONE or fenced after FAILED)."""

    transfer_id: int
    ok: bool
    reason: str | None
    seconds: float
    nbytes: int


@dataclass(frozen=True)
class PeerDead:
    """The peer of an expected transfer (no session yet) died or restarted: no KV will move."""

    transfer_id: int
    reason: str


@dataclass(frozen=True)
class PeerClosed:
    """The peer aborted an expected transfer before this side opened a session for it."""

    transfer_id: int
    reason: str
    finished: bool  # the peer's token 0 ended the request


HubEvent = RecvDone | RecvFailed | RecvBlocksFree | SendEnded | PeerClosed | PeerDead

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[TransferHub, _P], _R]
            ) -> Callable[Concatenate[TransferHub, _P], _R]:
    """The method runs holding the hub's lock (not reentrant: a locked method calls no other)."""
    @functools.wraps(method)
    def call(hub: TransferHub, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with hub._lock:
            return method(hub, *args, **kwargs)

    return call


class TransferHub:
    def __init__(self, transport: Transport, cache: KVCache, layout: KVLayout,
                 generation: Callable[[int], int], lease_s: float, mode: Mode = Mode.PUSH,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport, self.cache, self.layout = transport, cache, layout
        self._inbox = Inbox(transport)
        self._generation, self._lease_s, self._mode, self._clock = generation, lease_s, mode, clock
        self._sends: dict[int, tuple[SendSession, float, int]] = {}
        self._recvs: dict[int, tuple[RecvSession, float, int]] = {}
        self._failed_held: set[int] = set()  # failure reported, blocks not yet quiet
        self._expected: dict[int, PeerId] = {}  # transfer id -> the peer the leg names
        self._closed: dict[int, float] = {}  # transfer id -> when it closed
        self._unclaimed_since: dict[int, float] = {}
        self._peer_aborts: dict[int, str] = {}  # closed by the peer before anyone expected it
        self._held_at: dict[int, float] = {}  # held id -> when its last HOLD went (or expect)
        self._pending: list[HubEvent] = []
        self._lock = threading.Lock()

    @property
    def local(self) -> PeerId:
        return self.transport.local

    @property
    @_locked
    def active(self) -> int:
        return len(self._sends) + len(self._recvs)

    @_locked
    def is_closed(self, transfer_id: int) -> bool:
        return transfer_id in self._closed

    @_locked
    def expect(self, transfer_id: int, peer: PeerId) -> str | None:
        """A leg waits for `transfer_id` with `peer`, which is reached now. If the peer already
        aborted it (its ABORT overtook the leg), the next `poll` reports that as PeerClosed.
        Returns why, if `peer` is known dead: the id is closed then, and no session will open."""
        if transfer_id in self._peer_aborts:
            reason = self._peer_aborts.pop(transfer_id)
            self._pending.append(PeerClosed(transfer_id, reason, reason == FINISHED_AT_TOKEN0))
            return None
        if not self.transport.peer_alive(peer):
            self._closed[transfer_id] = self._clock()
            return self._death(peer)
        self._expected[transfer_id] = peer
        self._held_at[transfer_id] = self._clock()
        self.transport.reach(peer)
        return None

    @_locked
    def stream_layers(self, transfer_id: int, peer: PeerId, src_blocks: Sequence[int],
                      num_layers: int) -> None:
        """Layer-wise push: layers [0, num_layers) of a prompt still being computed are in
        `src_blocks`. The first call opens the send session (token 0 comes with `open_send`);
        each call writes the new layers once the receiver's reservation is in. A session that
        ends before token 0 is not reported: the transfer is closed, and `open_send` says so.
        Pull mode, or a transfer already closed: nothing."""
        if self._mode is not Mode.PUSH or transfer_id in self._closed:
            return
        if transfer_id not in self._sends:
            self._open_send(transfer_id, peer, src_blocks, None, None)
        self._sends[transfer_id][0].layers_ready(num_layers)

    @_locked
    def open_send(self, transfer_id: int, peer: PeerId, src_blocks: Sequence[int], token0: int,
                  logprob: float | None) -> bool:
        """Send the KV of `src_blocks` and token 0 (finishing a streamed session, if one is
        open). False when the transfer is closed (the decode side gave up, or a streamed
        session failed): nobody will read the blocks, release them."""
        if transfer_id in self._closed:
            return False
        open_ = self._sends.get(transfer_id)
        if open_ is None:
            self._open_send(transfer_id, peer, src_blocks, token0, logprob)
            return True
        session = open_[0]
        if session.src_blocks != tuple(src_blocks):  # a bug, never expected: fail safely
            session.abort("the prompt's blocks changed between layer streaming and token 0")
            return False
        session.prefill_done(token0, logprob)
        self._sends[transfer_id] = (session, self._clock(), open_[2])  # timed from token 0
        return True

    def _open_send(self, transfer_id: int, peer: PeerId, src_blocks: Sequence[int],
                   token0: int | None, logprob: float | None) -> None:
        self._expected.pop(transfer_id, None)
        session = SendSession(self._inbox, transfer_id=transfer_id, peer=peer, cache=self.cache,
                              layout=self.layout, src_blocks=src_blocks, token0=token0,
                              token0_logprob=logprob, mode=self._mode, lease_s=self._lease_s,
                              clock=self._clock)
        self._sends[transfer_id] = (session, self._clock(), self._nbytes(len(src_blocks)))

    @_locked
    def open_recv(self, transfer_id: int, peer: PeerId, dst_blocks: Sequence[int]) -> None:
        self._expected.pop(transfer_id, None)
        session = RecvSession(
            self._inbox, transfer_id=transfer_id, peer=peer, cache=self.cache,
            layout=self.layout, dst_blocks=dst_blocks,
            dst_generations=[self._generation(b) for b in dst_blocks],
            generation=self._generation, mode=self._mode, lease_s=self._lease_s,
            clock=self._clock)
        self._recvs[transfer_id] = (session, self._clock(), self._nbytes(len(dst_blocks)))

    @_locked
    def abort(self, transfer_id: int, reason: str) -> None:
        """Fail an open session (it keeps being polled until its blocks are free)."""
        if transfer_id in self._sends:
            self._sends[transfer_id][0].abort(reason)
        elif transfer_id in self._recvs:
            self._recvs[transfer_id][0].abort(reason)

    @_locked
    def close(self, transfer_id: int, peer: PeerId | None, reason: str) -> None:
        """This side will never open a session for `transfer_id`; tell `peer`. A streamed
        session still open is aborted first (its writes fenced before its ABORT goes out)."""
        self._expected.pop(transfer_id, None)
        if transfer_id in self._sends:
            self._sends.pop(transfer_id)[0].abort(reason)
            self._closed[transfer_id] = self._clock()
            return
        self._closed[transfer_id] = self._clock()
        if peer is not None:
            self._send(peer, transfer_id, ControlOp.ABORT, reason)

    def close_finished(self, transfer_id: int, peer: PeerId) -> None:
        """`close` telling the peer that token 0 ended the request (locked by `close`)."""
        self.close(transfer_id, peer, FINISHED_AT_TOKEN0)

    @_locked
    def poll(self) -> list[HubEvent]:
        events, self._pending = self._pending, []
        for tid, (session, t0, nbytes) in list(self._sends.items()):
            session.poll()
            if session.blocks_reusable:
                del self._sends[tid]
                self._closed[tid] = self._clock()
                if not session.prefilling:  # else the engine still computes; open_send tells
                    events.append(SendEnded(tid, session.state is TransferState.DONE,
                                            session.reason, self._clock() - t0, nbytes))
        for tid, (session, t0, nbytes) in list(self._recvs.items()):
            session.poll()
            if session.state is TransferState.DONE:
                events.append(RecvDone(tid, session.token0, session.token0_logprob,
                                       self._clock() - t0, nbytes))
            elif session.state is not TransferState.FAILED:
                continue
            elif tid in self._failed_held:
                if not session.blocks_reusable:
                    continue
                self._failed_held.discard(tid)
                events.append(RecvBlocksFree(tid))
            else:
                free = session.blocks_reusable
                events.append(RecvFailed(tid, session.reason or "failed",
                                         session.sender_finished, free))
                if not free:  # the leg need not wait for a silent writer: report it now
                    self._failed_held.add(tid)
                    continue
            del self._recvs[tid]
            self._closed[tid] = self._clock()
        events += self._handle_unclaimed()
        events += self._dead_expected()
        self._send_holds()
        self._forget_old()
        return events

    def _send_holds(self) -> None:
        """A HOLD to the peer of every id held here without its KV moving yet, every third of
        the lease (see the module docstring)."""
        now = self._clock()
        held = dict(self._expected)
        held |= {tid: s.peer for tid, (s, _, _) in self._sends.items() if s.prefilling}
        for tid in self._held_at.keys() - held.keys():
            del self._held_at[tid]
        for tid, peer in held.items():
            if now - self._held_at.setdefault(tid, now) >= self._lease_s / 3:
                self._send(peer, tid, ControlOp.HOLD)
                self._held_at[tid] = now

    def _dead_expected(self) -> list[HubEvent]:
        """Expected ids whose peer died or restarted before a session opened: closed, and
        reported so that their legs end (prefill) or recompute (decode) now."""
        alive = {peer: self.transport.peer_alive(peer) for peer in set(self._expected.values())}
        dead = [(tid, peer) for tid, peer in self._expected.items() if not alive[peer]]
        for tid, _ in dead:
            del self._expected[tid]
            self._closed[tid] = self._clock()
        return [PeerDead(tid, self._death(peer)) for tid, peer in dead]

    def _death(self, peer: PeerId) -> str:
        return f"the peer {peer} died ({self.transport.why_dead(peer) or 'dead'})"

    # -- messages no session owns ------------------------------------------------------------

    def _handle_unclaimed(self) -> list[HubEvent]:
        events: list[HubEvent] = []
        for tid in self._inbox.waiting_ids():
            if tid in self._sends or tid in self._recvs:
                continue
            if tid in self._closed:
                for source, msg in self._inbox.take(tid):
                    self._answer_closed(tid, source, msg)
                continue
            waiting = [m for _, m in self._inbox.peek(tid)]
            aborts = [m for m in waiting if _is_op(m, ControlOp.ABORT)]
            if not aborts and all(_is_op(m, ControlOp.HOLD) for m in waiting):
                self._inbox.take(tid)  # the peer waits, alive: nothing here to renew yet
                continue
            if aborts:
                for source, _ in self._inbox.take(tid):
                    self._send(source, tid, ControlOp.ABORT_ACK)  # we will never write
                self._closed[tid] = self._clock()
                reason = aborts[0].reason
                if tid in self._expected:
                    del self._expected[tid]
                    events.append(PeerClosed(tid, reason, reason == FINISHED_AT_TOKEN0))
                else:
                    self._peer_aborts[tid] = reason
            else:
                self._unclaimed_since.setdefault(tid, self._clock())
        return events

    def _answer_closed(self, tid: int, source: PeerId, msg: object) -> None:
        if _is_op(msg, ControlOp.ABORT):
            self._send(source, tid, ControlOp.ABORT_ACK)
        elif not _is_op(msg, ControlOp.ABORT_ACK):  # a HOLD too: the peer's wait is over
            self._send(source, tid, ControlOp.ABORT, "the transfer is closed at this peer")

    def _forget_old(self) -> None:
        now = self._clock()
        for tid, since in list(self._unclaimed_since.items()):
            if tid not in self._expected and now - since > self._lease_s:
                self._inbox.discard(tid)
                del self._unclaimed_since[tid]
            elif tid in self._sends or tid in self._recvs or tid in self._closed:
                del self._unclaimed_since[tid]
        for tid, since in list(self._closed.items()):
            if now - since > CLOSED_MEMORY_S:
                del self._closed[tid]
                self._peer_aborts.pop(tid, None)

    def _send(self, peer: PeerId, tid: int, op: ControlOp, reason: str = "") -> None:
        msg = ControlMessage(tid, self.transport.local, op, reason[:MAX_REASON_CHARS])
        self.transport.send(peer, msg.encode())

    def _nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.num_layers * self.layout.slice_nbytes


def _is_op(msg: object, op: ControlOp) -> bool:
    return isinstance(msg, ControlMessage) and msg.op is op
