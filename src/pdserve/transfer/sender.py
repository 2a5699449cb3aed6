"""The prefill side of one KV transfer: `SendSession`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.checksum import slices_crc32c
from pdserve.transfer.control import MAX_REASON_CHARS, ControlMessage, ControlOp, Reservation
from pdserve.transfer.descriptors import CompletionNotice, KVLayout, PeerId, TransferDescriptor
from pdserve.transfer.sessions import DEFAULT_LEASE_S, Inbox, Lease, Link, Mode, Trust
from pdserve.transfer.state import TransferState, TransferStatus
from pdserve.transfer.transport import MoveHandle

S = TransferState
_DONE_OP = {Mode.PUSH: ControlOp.ACK, Mode.PULL: ControlOp.RELEASE}  # the receiver's "done"


class SendSession:
    """Moves the KV of `src_blocks` (and token 0) to one receiver.

    Life cycle, push: WAITING_FOR_BLOCKS until the receiver's Reservation arrives ->
    TRANSFERRING (descriptor sent, write issued; once the write is done: CRC32C of every sent
    (block, layer) slice and a CompletionNotice) -> DONE on the receiver's ACK.
    Life cycle, pull: WAITING_FOR_BLOCKS -> TRANSFERRING (descriptor with checksums and the
    notice sent; the blocks are leased to the reader) -> DONE on the receiver's RELEASE.
    FAILED from any live state: lease expiry, write error, a dead peer or endpoint, a bad
    reservation, a message from a restarted receiver instance, the receiver's ABORT, abort().

    Invariants: the state only moves forward (TransferStatus). Before FAILED the session
    cancels (fences) its write, so an ABORT from a sender always means "I will never write
    again"; a FAILED session still answers a receiver's ABORT with ABORT_ACK on poll().
    Lifetime: from the prefill output (blocks held, PREFILLED) until `blocks_reusable`, when
    the caller releases the source blocks. In pull mode a reader that is still reading when a
    failed sender frees its blocks reads garbage, which the receiver's CRC32C check rejects.
    """

    def __init__(
        self, inbox: Inbox, *, transfer_id: int, peer: PeerId, cache: KVCache,
        layout: KVLayout, src_blocks: Sequence[int], token0: int,
        token0_logprob: float | None = None, mode: Mode = Mode.PUSH,
        lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not src_blocks or len(set(src_blocks)) != len(src_blocks):
            raise ValueError("src_blocks must be non-empty and must not repeat a block")
        self._link = Link(inbox, inbox.transport.local, peer, transfer_id)
        self._cache, self._layout, self._mode = cache, layout, mode
        self._src = tuple(src_blocks)
        self._token0 = CompletionNotice(transfer_id, self._link.local, (), token0, token0_logprob)
        self._status = TransferStatus(S.WAITING_FOR_BLOCKS, clock)
        self._lease = Lease(lease_s, clock)
        self._write: MoveHandle | None = None
        self._notified = False

    @property
    def transfer_id(self) -> int:
        return self._link.transfer_id

    @property
    def state(self) -> TransferState:
        return self._status.state

    @property
    def reason(self) -> str | None:
        return self._status.reason

    @property
    def blocks_reusable(self) -> bool:
        """True once terminal: the write is done or fenced, no receiver needs the blocks."""
        return self._status.is_terminal

    def poll(self) -> TransferState:
        """Handle arrived messages, check the write, the peer and the lease. Never blocks."""
        for trust, msg in self._link.take():
            self._on_message(trust, msg)
        if not self._status.is_terminal:
            self._check_progress()
        return self.state

    def abort(self, reason: str) -> None:
        """Fail now (fence the write) and tell the receiver."""
        self._fail(f"aborted by the caller: {reason}")

    # -- messages ------------------------------------------------------------------------------

    def _on_message(self, trust: Trust, msg: object) -> None:
        if trust is Trust.STALE:
            self._fail("message from another instance of the receiver's address (restarted "
                       "peer); not trusted")
        elif trust is Trust.TRUSTED and isinstance(msg, Reservation):
            self._on_reservation(msg)
        elif trust is Trust.TRUSTED and isinstance(msg, ControlMessage):
            self._on_control(msg)

    def _on_control(self, msg: ControlMessage) -> None:
        if msg.op is ControlOp.ABORT:
            self._fail(f"the receiver aborted: {msg.reason}", tell=False)
            if self._mode is Mode.PUSH:
                self._link.control(ControlOp.ABORT_ACK)
        elif msg.op is _DONE_OP[self._mode] and self._notified:
            self._status.advance(S.DONE)

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
        self._link.send(TransferDescriptor(
            self._link.transfer_id, self._link.local, self._link.peer, self._src,
            r.dst_block_ids, r.dst_generations, r.layer_begin, r.layer_end, self._layout, sums))
        if self._mode is Mode.PUSH:
            self._write = self._link.transport.write(
                self._link.transfer_id, self._src, self._link.peer, r.dst_block_ids)
        else:
            self._send_notice(sums)
        self._status.advance(S.TRANSFERRING)

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

    def _check_progress(self) -> None:
        if not self._link.self_alive():
            self._fail("this endpoint is dead", tell=False)
        elif not self._link.peer_alive():
            self._fail(f"the receiver {self._link.peer} died", tell=False)
        elif self._write is not None and not self._notified:
            self._check_write()
        if not self._status.is_terminal and self._lease.expired:
            self._fail("the lease expired")

    def _check_write(self) -> None:
        status = self._link.transport.status(self._write)
        if status == "error":
            self._fail("the write failed")
        elif status == "done":
            self._send_notice(tuple(slices_crc32c(self._cache.data, self._src,
                                                  range(self._layout.num_layers))))

    def _send_notice(self, checksums: tuple[int, ...]) -> None:
        t = self._token0
        self._link.send(CompletionNotice(t.transfer_id, t.sender, checksums, t.token0,
                                         t.token0_logprob))
        self._notified = True

    def _fail(self, reason: str, tell: bool = True) -> None:
        if self._write is not None:
            self._link.transport.cancel(self._write)  # the fence comes before any ABORT
        if self._status.fail(reason) and tell:
            self._link.control(ControlOp.ABORT, reason[:MAX_REASON_CHARS])
