"""The prefill side of one KV transfer: `SendSession`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.checksum import slices_crc32c
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import (
    MAX_REASON_CHARS,
    CompletionNotice,
    ControlMessage,
    ControlOp,
    Message,
    Reservation,
    TransferDescriptor,
)
from pdserve.transfer.peer import PeerId
from pdserve.transfer.sessions import DEFAULT_LEASE_S, Inbox, Mode, Session
from pdserve.transfer.state import TransferState
from pdserve.transfer.transport import MoveHandle

S = TransferState
_DONE_OP = {Mode.PUSH: ControlOp.ACK, Mode.PULL: ControlOp.RELEASE}  # the receiver's "done"


class SendSession(Session):
    """Moves the KV of `src_blocks` (and token 0) to one receiver.

    Life cycle, push: WAITING_FOR_BLOCKS until the receiver's Reservation arrives ->
    TRANSFERRING (descriptor sent, write issued; once the write is done: CRC32C of every sent
    (block, layer) slice and a CompletionNotice) -> DONE on the receiver's ACK.
    Life cycle, pull: WAITING_FOR_BLOCKS -> TRANSFERRING (descriptor with checksums and the
    notice sent; the blocks are leased to the reader) -> DONE on the receiver's RELEASE.
    FAILED from any live state: lease expiry, write error, a dead peer or endpoint, a bad
    reservation, a message from a restarted receiver instance, the receiver's ABORT, abort().
    The lease runs from token 0 (a streamed session holds it while the prompt computes: the
    wait is this side's compute, which the receiver hears of as HOLDs) and the receiver's
    HOLD (its reservation waits for pool room) renews it.

    Layer-wise streaming (push): a session opened with `token0=None` while the prompt is still
    being computed writes layers [sent, ready) of every block each time `layers_ready(ready)`
    raises the count and the reservation is in (one move per call), and the rest at
    `prefill_done(token0)`; the notice goes once token 0 is known and every move is done.
    A session opened with token 0 writes every layer in one move, as before.

    Invariants: the state only moves forward (TransferStatus). Before FAILED the session
    cancels (fences) every write, so an ABORT from a sender always means "I will never write
    again"; a FAILED session still answers a receiver's ABORT with ABORT_ACK on poll().
    Permit (pull): the descriptor goes out only after `allow_reads` let exactly the paired
    receiver instance read exactly `src_blocks` under this transfer id, and every terminal
    path (DONE on RELEASE, any FAILED) revokes it, so the permit exists only while the blocks
    are held for this transfer. Push grants nothing: this side writes.
    Lifetime: from the prefill output (blocks held, PREFILLED; streamed: from the step that
    computes the prompt's last tokens) until `blocks_reusable`, when
    the caller releases the source blocks. In pull mode the revoke is the fence over TCP (a
    READ_DATA frame going out finishes first, and none follows); over NIXL a reader that is
    still reading when a failed sender frees its blocks reads garbage, which the receiver's
    CRC32C check rejects.
    """

    peer_role = "receiver"

    def __init__(
        self, inbox: Inbox, *, transfer_id: int, peer: PeerId, cache: KVCache,
        layout: KVLayout, src_blocks: Sequence[int], token0: int | None,
        token0_logprob: float | None = None, mode: Mode = Mode.PUSH,
        lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not src_blocks or len(set(src_blocks)) != len(src_blocks):
            raise ValueError("src_blocks must be non-empty and must not repeat a block")
        if token0 is None and mode is not Mode.PUSH:
            raise ValueError("layer-wise streaming (token0=None) is a push-mode feature")
        super().__init__(inbox, transfer_id=transfer_id, peer=peer, cache=cache, layout=layout,
                         mode=mode, start=S.WAITING_FOR_BLOCKS, lease_s=lease_s, clock=clock)
        self._src = tuple(src_blocks)
        self._token0: CompletionNotice | None = None
        self._dst: tuple[int, ...] | None = None  # push: the reserved blocks, once known
        self._ready = self._sent = 0  # layers computed / written
        self._writes: list[MoveHandle] = []
        self._notified = False
        if token0 is not None:
            self.prefill_done(token0, token0_logprob)

    @property
    def src_blocks(self) -> tuple[int, ...]:
        return self._src

    @property
    def writes_issued(self) -> int:
        """Moves handed to the transport so far (push: one per `layers_ready` step)."""
        return len(self._writes)

    @property
    def prefilling(self) -> bool:
        """Opened for layer-wise streaming and token 0 not known yet."""
        return self._token0 is None

    @property
    def blocks_reusable(self) -> bool:
        """True once terminal: the write is done or fenced, no receiver needs the blocks."""
        return self._status.is_terminal

    def poll(self) -> TransferState:
        """Handle arrived messages, check the write, the peer and the lease. Never blocks."""
        if self.prefilling:
            self._lease.renew()  # the prompt is still computing here: nothing to time yet
        self._take_messages()
        if not self._status.is_terminal:
            self._check_progress()
        return self.state

    def layers_ready(self, num_layers: int) -> None:
        """Layers [0, num_layers) of the prompt are in `src_blocks`; write the new ones now if
        the receiver's blocks are known."""
        self._ready = max(self._ready, min(num_layers, self._layout.num_layers))
        self._write_ready()

    def prefill_done(self, token0: int, token0_logprob: float | None = None) -> None:
        """Every layer is computed and token 0 sampled: the notice can follow the writes."""
        self._token0 = CompletionNotice(self._link.transfer_id, self._link.local, (), token0,
                                        token0_logprob)
        self._lease.renew()
        self.layers_ready(self._layout.num_layers)

    def abort(self, reason: str) -> None:
        """Fail now (fence every write) and tell the receiver `reason` as given (it may be
        FINISHED_AT_TOKEN0, which the receiver reads as "the request ended at token 0")."""
        self._fail(f"aborted by the caller: {reason}", told=reason)

    # -- messages ------------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Reservation):
            self._on_reservation(msg)
        elif isinstance(msg, ControlMessage):
            self._on_control(msg)

    def _on_control(self, msg: ControlMessage) -> None:
        if msg.op is ControlOp.ABORT:
            self._fail(f"the receiver aborted: {msg.reason}", tell=False)
            if self._mode is Mode.PUSH:
                self._link.control(ControlOp.ABORT_ACK)
        elif msg.op is _DONE_OP[self._mode] and self._notified:
            self._status.advance(S.DONE)
            self._link.transport.revoke(self.transfer_id)

    def _on_reservation(self, r: Reservation) -> None:
        if self.state is not S.WAITING_FOR_BLOCKS:
            return  # a duplicate: the first one was answered
        problem = self._reservation_problem(r)
        if problem:
            self._fail(problem)
            return
        layers = range(r.layer_begin, r.layer_end)
        sums = slices_crc32c(self._cache.data, self._src, layers) if self._mode is Mode.PULL \
            else ()
        if self._mode is Mode.PULL:
            self._link.transport.allow_reads(self.transfer_id, self._link.peer, self._src)
        self._link.send(TransferDescriptor(
            self._link.transfer_id, self._link.local, self._link.peer, self._src,
            r.dst_block_ids, r.dst_generations, r.layer_begin, r.layer_end, self._layout, sums))
        self._status.advance(S.TRANSFERRING)
        if self._mode is Mode.PUSH:
            self._dst = r.dst_block_ids
            self._write_ready()
        else:
            self._send_notice(sums)

    def _reservation_problem(self, r: Reservation) -> str | None:
        try:
            self._layout.check_compatible(r.layout)
        except ValueError as e:
            return str(e)
        if r.num_blocks != len(self._src):
            return f"the receiver reserved {r.num_blocks} blocks for {len(self._src)}"
        if (r.layer_begin, r.layer_end) != (0, self._layout.num_layers):
            return "layer ranges other than every layer are not supported yet"
        return None

    # -- progress ------------------------------------------------------------------------------

    def _write_ready(self) -> None:
        """Push: one move for the layers computed since the last one, once the receiver's
        blocks are known (every layer at once when none was streamed)."""
        if self._dst is None or self._status.is_terminal or self._ready <= self._sent:
            return
        whole = (self._sent, self._ready) == (0, self._layout.num_layers)
        self._writes.append(self._link.transport.write(
            self._link.transfer_id, self._src, self._link.peer, self._dst,
            None if whole else range(self._sent, self._ready)))
        self._sent = self._ready

    def _check_moves(self) -> None:
        if not self._writes or self._notified:
            return
        statuses = [self._link.transport.status(w) for w in self._writes]
        if "error" in statuses:
            self._fail("the write failed")
        elif self._token0 is not None and self._sent == self._layout.num_layers \
                and all(s == "done" for s in statuses):
            self._send_notice(tuple(slices_crc32c(self._cache.data, self._src,
                                                  range(self._layout.num_layers))))

    def _send_notice(self, checksums: tuple[int, ...]) -> None:
        t = self._token0
        assert t is not None
        self._link.send(CompletionNotice(t.transfer_id, t.sender, checksums, t.token0,
                                         t.token0_logprob))
        self._notified = True

    def _fail(self, reason: str, tell: bool = True, told: str | None = None) -> None:
        for write in self._writes:
            self._link.transport.cancel(write)  # the fence comes before any ABORT
        self._link.transport.revoke(self.transfer_id)
        if self._status.fail(reason) and tell:
            self._link.control(ControlOp.ABORT, (told or reason)[:MAX_REASON_CHARS])
