"""The decode side of one KV transfer: `RecvSession`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import (
    FINISHED_AT_TOKEN0,
    MAX_REASON_CHARS,
    CompletionNotice,
    ControlMessage,
    ControlOp,
    Message,
    Reservation,
    TransferDescriptor,
)
from pdserve.transfer.peer import PeerId
from pdserve.transfer.sessions import DEFAULT_LEASE_S, DEFAULT_RESEND_S, Inbox, Mode, Session
from pdserve.transfer.state import TransferState
from pdserve.transfer.transport import MoveHandle
from pdserve.transfer.verify import verify_transfer

S = TransferState


class RecvSession(Session):
    """Lands one request's KV in reserved `dst_blocks` and verifies it before admission.

    Life cycle (both modes): BOOTSTRAPPING -> WAITING_FOR_BLOCKS once the first poll() sent
    the Reservation (destination blocks + generations).
    push: -> TRANSFERRING on the sender's descriptor (it must match the reservation) -> on the
    CompletionNotice, verify_transfer: DONE (ACK sent) or FAILED (ABORT sent).
    pull: -> TRANSFERRING once the descriptor (with checksums) and the notice are in and the
    read is issued -> when the read is done, verify_transfer: DONE (RELEASE) or FAILED (ABORT).
    FAILED also on lease expiry, a dead peer or endpoint, a descriptor that does not match,
    a message from a restarted sender instance, the sender's ABORT, a failed read, abort().
    Late or duplicate messages never revive a terminal session.

    Invariant (no reuse while a writer may write): `blocks_reusable` is True only when DONE
    (verified; in push the writer finished before it sent the notice) or FAILED and the
    writer is quiet: it never learnt where to write, its notice came (write finished), it sent
    ABORT or ABORT_ACK (a sender fences its write first), it is known dead, or (pull) our own
    read was fenced. A FAILED push session keeps re-sending ABORT every `resend_s` on poll()
    until then.

    Permit (push): the Reservation goes out only after `allow_writes` let exactly the paired
    sender instance write exactly the reserved blocks (and layers) under this transfer id, and
    every terminal path (DONE, any FAILED: abort, lease, peer, verification) revokes it. So
    the permit exists only while the blocks are reserved for this transfer and carry the
    generations the Reservation names; a write from anyone else, into other blocks or after
    the end is refused by a transport that can check it (`transport.py`). Pull grants nothing:
    this side reads. Lifetime: from the reservation until the caller, seeing DONE, hands the blocks
    to the engine (`kv_ready(token0)`) or, seeing `blocks_reusable` after FAILED, frees them
    (`Engine.abort`). The caller decides on retry or local recompute.
    """

    peer_role = "sender"

    def __init__(
        self, inbox: Inbox, *, transfer_id: int, peer: PeerId, cache: KVCache,
        layout: KVLayout, dst_blocks: Sequence[int], dst_generations: Sequence[int],
        generation: Callable[[int], int], mode: Mode = Mode.PUSH,
        lease_s: float = DEFAULT_LEASE_S, resend_s: float = DEFAULT_RESEND_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(inbox, transfer_id=transfer_id, peer=peer, cache=cache, layout=layout,
                         mode=mode, start=S.BOOTSTRAPPING, lease_s=lease_s, clock=clock)
        self._reservation = Reservation(transfer_id, self._link.local, tuple(dst_blocks),
                                        tuple(dst_generations), 0, layout.num_layers, layout)
        self._generation, self._clock, self._resend_s = generation, clock, resend_s
        self._descriptor: TransferDescriptor | None = None
        self._notice: CompletionNotice | None = None
        self._read: MoveHandle | None = None
        self._writer_quiet = True  # nobody knows where to write yet
        self._abort_sent_at: float | None = None
        self.sender_finished = False  # the sender said token 0 ended the request (no KV comes)

    @property
    def token0(self) -> int | None:
        """The sender's token 0 once DONE, else None."""
        return self._notice.token0 if self.state is S.DONE else None

    @property
    def token0_logprob(self) -> float | None:
        return self._notice.token0_logprob if self.state is S.DONE else None

    @property
    def blocks_reusable(self) -> bool:
        """See the class invariant: True only when no writer can still touch the blocks."""
        return self.state is S.DONE or (self.state is S.FAILED and self._writer_quiet)

    def poll(self) -> TransferState:
        """Reserve, handle arrived messages, check the read, peer and lease. Never blocks."""
        if self.state is S.BOOTSTRAPPING:
            self._writer_quiet = self._mode is Mode.PULL
            if self._mode is Mode.PUSH:
                r = self._reservation
                self._link.transport.allow_writes(self.transfer_id, self._link.peer,
                                                  r.dst_block_ids,
                                                  range(r.layer_begin, r.layer_end))
            self._link.send(self._reservation)
            self._status.advance(S.WAITING_FOR_BLOCKS)
        self._take_messages()
        if not self._status.is_terminal:
            self._check_progress()
        if self.state is S.FAILED and not self._writer_quiet:
            self._wait_for_writer()
        return self.state

    def abort(self, reason: str) -> None:
        """Fail now and tell the sender; keep polling until `blocks_reusable`."""
        self._fail(f"aborted by the caller: {reason}")

    # -- messages ------------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, TransferDescriptor):
            self._on_descriptor(msg)
        elif isinstance(msg, CompletionNotice):
            self._on_notice(msg)
        elif isinstance(msg, ControlMessage):
            self._on_control(msg)

    def _on_control(self, msg: ControlMessage) -> None:
        if msg.op in (ControlOp.ABORT, ControlOp.ABORT_ACK):
            self._writer_quiet = True  # a sender fences its write before either
        if msg.op is ControlOp.ABORT:
            if not self.state.is_terminal:  # a later ABORT never rewrites why it ended
                self.sender_finished = msg.reason == FINISHED_AT_TOKEN0
            self._fail(f"the sender aborted: {msg.reason}", tell=False)

    def _on_descriptor(self, d: TransferDescriptor) -> None:
        if self.state is not S.WAITING_FOR_BLOCKS or self._descriptor is not None:
            return
        problem = self._descriptor_problem(d)
        if problem:
            self._fail(problem)
            return
        self._descriptor = d
        if self._mode is Mode.PUSH:
            self._status.advance(S.TRANSFERRING)
        else:
            self._maybe_read()

    def _descriptor_problem(self, d: TransferDescriptor) -> str | None:
        r = self._reservation
        if d.receiver != r.receiver or (d.dst_block_ids, d.dst_generations) != (
                r.dst_block_ids, r.dst_generations):
            return "the sender's descriptor does not match the reservation"
        if (d.layer_begin, d.layer_end) != (r.layer_begin, r.layer_end) or d.layout != r.layout:
            return "the sender's descriptor names other layers or another layout"
        if self._mode is Mode.PULL and not d.checksums:
            return "a pull descriptor must carry checksums"
        return None

    def _on_notice(self, n: CompletionNotice) -> None:
        if self._mode is Mode.PUSH:
            self._writer_quiet = True  # sent only after the write completed
        if self._status.is_terminal or self._notice is not None:
            return  # late or duplicate: never revives, never re-verifies
        if self._descriptor is None or n.token0 is None:
            self._fail("completion notice before the descriptor, or without token 0")
            return
        self._notice = n
        if self._mode is Mode.PUSH:
            self._verify()
        else:
            self._maybe_read()

    # -- progress ------------------------------------------------------------------------------

    def _maybe_read(self) -> None:
        if self._descriptor is None or self._notice is None or self._read is not None:
            return
        self._read = self._link.transport.read(
            self._link.transfer_id, self._reservation.dst_block_ids, self._link.peer,
            self._descriptor.src_block_ids)
        self._status.advance(S.TRANSFERRING)

    def _check_moves(self) -> None:
        if self._read is None:
            return
        status = self._link.transport.status(self._read)
        if status == "error":
            self._fail("the read failed")
        elif status == "done":
            self._verify()

    def _verify(self) -> None:
        report = verify_transfer(self._cache, self._descriptor, self._notice, self._generation)
        if not report.ok:
            self._fail(f"verification failed: {report.reason}")
            return
        op = ControlOp.ACK if self._mode is Mode.PUSH else ControlOp.RELEASE
        self._status.advance(S.DONE)
        self._link.transport.revoke(self.transfer_id)  # the blocks go to the engine now
        self._link.control(op)

    def _wait_for_writer(self) -> None:
        if not self._link.self_alive() or not self._link.peer_alive():
            self._writer_quiet = True  # a dead endpoint is neither written by nor writes
            return
        if self._abort_sent_at is None or self._clock() - self._abort_sent_at >= self._resend_s:
            self._send_abort()

    def _fail(self, reason: str, tell: bool = True) -> None:
        if self._read is not None:
            self._link.transport.cancel(self._read)  # our own read is fenced
        failed = self._status.fail(reason)
        self._link.transport.revoke(self.transfer_id)
        if failed and tell:
            self._send_abort()

    def _send_abort(self) -> None:
        self._link.control(ControlOp.ABORT, (self._status.reason or "")[:MAX_REASON_CHARS])
        self._abort_sent_at = self._clock()
