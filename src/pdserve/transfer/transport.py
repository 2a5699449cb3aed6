"""The interface every transport implements: move KV bytes between registered pools, and
carry small control messages.

A transport is one endpoint (one worker process, `local`), shared by all of its sessions.
Data moves are one-sided, in the two RDMA shapes: `write` pushes local blocks into a peer's
pool, `read` pulls a peer's blocks into the local pool. A move is identified by an opaque
handle whose `status` goes "pending" -> "done" or "error" (never back). `cancel` is the
fence that makes block reuse safe: once it returns, the move will never touch either pool
again (a pending move ends as "error"; a finished one keeps its status).

The control channel is unordered-safe, non-blocking and lossy: `send` never blocks and may
lose messages (a dead peer); `receive` returns what has arrived since the last call, each
with the transport-level source peer (the authenticated origin in a real transport).

Permits (`permits.py`): a move a peer starts lands in, or reads from, this endpoint's pool
only inside a permit this endpoint granted for that transfer id to that exact peer instance
(`allow_writes` / `allow_reads`, until `revoke`); any other is refused whole and ends "error"
at its initiator, and no block of it is touched. A refused move never ends the connection or
marks anyone dead. Invariant kept by the sessions: a permit exists only while its blocks are
reserved or held for that transfer. Where the target cannot check a one-sided move (NIXL),
the transport says so in its docstring.

Peers (`PeerId`, one process lifetime each): an instance is alive until known dead, and dead
for good. One instance answers at an address at a time, so the first authenticated contact
with a new instance there (it dials us, or we dial the instance the router names and it
answers) makes the old one dead at once, with "restarted" in `why_dead`; every session with
the old one then fails on its next poll and its blocks are free (`sessions.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from pdserve.transfer.link_report import LinkReport
from pdserve.transfer.peer import PeerId

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

MoveStatus = Literal["pending", "done", "error"]
MoveHandle = int


def layer_span(layers: range | None, num_layers: int) -> tuple[int, int]:
    """(first, end) of a move's layers: every layer for None; ValueError unless `layers` is a
    non-empty step-1 range inside [0, num_layers)."""
    if layers is None:
        return 0, num_layers
    if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start \
            < layers.stop <= num_layers:
        raise ValueError(f"layers must be a non-empty range inside [0, {num_layers}), "
                         f"got {layers!r}")
    return layers.start, layers.stop


class Transport(Protocol):
    """One endpoint of the transfer plane (fake, tcp, nixl)."""

    @property
    def local(self) -> PeerId:
        """This endpoint's peer id (instance included)."""
        ...

    def register(self, pool: KVCache) -> None:
        """Make `pool` the local KV pool that moves read from and write into."""
        ...

    def write(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
              remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        """Push local block i into remote block i (RDMA-WRITE shape); only the `layers` slices
        of each block when given (layer-wise streaming), else every layer."""
        ...

    def read(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
             remote_blocks: Sequence[int]) -> MoveHandle:
        """Pull remote block i into local block i (RDMA-READ shape)."""
        ...

    def allow_writes(self, transfer_id: int, peer: PeerId, blocks: Sequence[int],
                     layers: range | None = None) -> None:
        """Let `peer` (that exact instance) write into local `blocks` (only `layers` of them,
        when given) under `transfer_id`, until `revoke(transfer_id)`."""
        ...

    def allow_reads(self, transfer_id: int, peer: PeerId, blocks: Sequence[int]) -> None:
        """Let `peer` (that exact instance) read local `blocks` under `transfer_id`, until
        `revoke(transfer_id)`."""
        ...

    def revoke(self, transfer_id: int) -> None:
        """End every permit of `transfer_id` (idempotent); later moves under it are refused."""
        ...

    def status(self, handle: MoveHandle) -> MoveStatus:
        ...

    def cancel(self, handle: MoveHandle) -> None:
        """Fence: after return the move never touches either pool again."""
        ...

    def send(self, peer: PeerId, message: bytes) -> None:
        """Queue one control message to `peer`; never blocks, may be lost."""
        ...

    def receive(self) -> list[tuple[PeerId, bytes]]:
        """Every control message that arrived since the last call; never blocks."""
        ...

    def peer_alive(self, peer: PeerId) -> bool:
        """The transport's view of whether that exact instance is still up: False once it is
        known dead (it died, or another instance proved itself at its address: a restart),
        for good. An instance not met yet is alive until contact shows otherwise, so a newer
        instance the router names at a known address is dialed, not refused."""
        ...

    def why_dead(self, peer: PeerId) -> str | None:
        """Why that instance is held dead ("restarted: instance ... now answers at ...", "the
        connection closed", ...); None while `peer_alive`."""
        ...

    def peers_lost(self) -> int:
        """How many peer instances this endpoint holds lost now: unreachable (their connection
        ended, was reset or could not be made: a partition, a host that stopped answering)
        and not yet due to be dialed again. Dead-for-good instances (restarted, refused) are
        not counted; a transport that knows every death at once has none."""
        ...

    def links(self) -> list[LinkReport]:
        """What this endpoint measured of its link to each peer it moved KV to
        (`link_report.py`); never blocks."""
        ...

    def reach(self, peer: PeerId) -> None:
        """Make contact with `peer` now, without sending anything and without blocking: a
        transport with connections dials it, so its death (or a restart at its address) is
        known before a message must go to it. Called when a transfer with `peer` is announced
        or opened; idempotent."""
        ...
