"""The TCP endpoint's moves: each write or read this endpoint started, and its fence.

A move is "pending" until its peer answers (a WRITE_DONE for each of a write's frames, or a
WRITE_ERROR), every (block, layer) slice of a read has arrived in its READ_DATA frames (a
READ_ERROR instead fails it, whatever part of it landed), or it fails; then "done" or "error",
never back.
While a thread sends a write's frame or lands a read's bytes, the move is `busy` on that
connection; `cancel` marks it cancelled (no next frame or step starts) and waits for it to
be quiet before it returns: the fence the sessions rely on. Every field of a `Move` is
guarded by its `MoveTable`'s lock.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp.frames import ProtocolError, shut
from pdserve.transfer.transport import MoveHandle, MoveStatus

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Move:
    """One write or read. `busy` is true while a thread sends (write) or lands (read) its bytes
    on `sock`; `cancelled` stops it before the next step."""

    handle: MoveHandle
    kind: str  # "write" | "read"
    transfer_id: int
    peer: PeerId
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    layers: tuple[int, int] | None = None  # a write's [first, end) layers; None: every layer
    frames: int = 0  # a write's frames (known once its first one is sent)
    frames_done: int = 0  # of those, answered WRITE_DONE
    slices: int = 0  # a read's (block, layer) slices arrived so far, in block-major order
    status: MoveStatus = "pending"
    cancelled: bool = False
    busy: bool = False
    sock: socket.socket | None = field(default=None, repr=False)


class MoveTable:
    """Every move of one endpoint by handle. Thread-safe: the caller's thread starts, polls and
    cancels; the sender threads claim writes; the reader threads land reads and answers.
    `cancel_wait_s` bounds how long `cancel` waits for a busy move before it shuts that
    connection down. Lifetime: the endpoint's (moves are kept, so a handle stays valid)."""

    def __init__(self, cancel_wait_s: float) -> None:
        self._cancel_wait_s = cancel_wait_s
        self._lock = threading.Condition()
        self._moves: dict[MoveHandle, Move] = {}
        self._handles = itertools.count(1)

    def add(self, kind: str, tid: int, peer: PeerId, local_blocks: tuple[int, ...],
            remote_blocks: tuple[int, ...], layers: tuple[int, int] | None) -> Move:
        with self._lock:
            move = Move(next(self._handles), kind, tid, peer, local_blocks, remote_blocks,
                        layers)
            self._moves[move.handle] = move
        return move

    def status(self, handle: MoveHandle) -> MoveStatus:
        with self._lock:
            return self._get(handle).status

    def cancel(self, handle: MoveHandle) -> None:
        """The fence: once this returns the move never touches a pool again (a busy one is
        waited for, and its connection shut down if it does not finish in time)."""
        with self._lock:
            move = self._get(handle)
            move.cancelled = True
            if move.status != "pending":
                return
            quiet = self._lock.wait_for(lambda: not move.busy, self._cancel_wait_s)
            force = None if quiet else move.sock
            self._finish(move, "error")
        if force is not None:
            log.warning("cancel of move %d timed out; dropping its connection", handle)
            shut(force)

    def claim(self, move: Move, sock: socket.socket) -> bool:
        """Mark a not-cancelled pending move busy on `sock`; False if it must not run."""
        with self._lock:
            if move.cancelled or move.status != "pending":
                return False
            move.busy, move.sock = True, sock
            return True

    def release(self, move: Move) -> None:
        with self._lock:
            move.busy = False
            self._lock.notify_all()

    def expect_frames(self, move: Move, frames: int) -> None:
        """A write goes out in `frames` frames; it is done when each is answered WRITE_DONE."""
        with self._lock:
            move.frames = frames

    def frame_done(self, move: Move) -> bool:
        """One of a write's frames landed: done once every frame has; False when cancelled."""
        with self._lock:
            if move.cancelled:
                return False
            move.frames_done += 1
            if move.frames_done >= move.frames:
                self._finish(move, "done")
            return True

    def slices_arrived(self, move: Move) -> int:
        """How many of a read's (block, layer) slices its READ_DATA frames have brought."""
        with self._lock:
            return move.slices

    def arrived(self, move: Move, slices: int, total: int) -> None:
        """`slices` more of a read's `total` slices arrived (landed, or drained when it was
        cancelled): a pending read is done once all have."""
        with self._lock:
            move.slices += slices
            if move.slices >= total and not move.cancelled:
                self._finish(move, "done")

    def settle(self, move: Move, status: MoveStatus) -> bool:
        """pending -> `status` unless the move was cancelled (its transfer ended here); False
        when it was cancelled."""
        with self._lock:
            if move.cancelled:
                return False
            self._finish(move, status)
            return True

    def fail(self, move: Move) -> None:
        """pending -> "error" (it could not be queued)."""
        with self._lock:
            self._finish(move, "error")

    def owned(self, peer: PeerId, mid: int, kind: str) -> Move:
        """The move `mid` of `kind` to `peer` an answer names; ProtocolError if there is none."""
        with self._lock:
            move = self._moves.get(mid)
        if move is None or move.peer != peer or move.kind != kind:
            raise ProtocolError(f"answer for move {mid}, which is not a {kind} to {peer}")
        return move

    def drop_peer(self, peer: PeerId) -> None:
        """`peer` is dead: its pending moves are cancelled and end in "error"."""
        self._cancel_all(lambda move: move.peer == peer)

    def close(self) -> None:
        """The endpoint closes: every pending move is cancelled and ends in "error"."""
        self._cancel_all(lambda move: True)

    def _cancel_all(self, which: Callable[[Move], bool]) -> None:
        with self._lock:
            for move in self._moves.values():
                if which(move):
                    move.cancelled = True
                    self._finish(move, "error")

    def _get(self, handle: MoveHandle) -> Move:
        move = self._moves.get(handle)
        if move is None:
            raise ValueError(f"move handle {handle} was not issued by this endpoint")
        return move

    def _finish(self, move: Move, status: MoveStatus) -> None:
        """pending -> status, never back. Caller holds the lock."""
        if move.status == "pending":
            move.status = status
            self._lock.notify_all()
