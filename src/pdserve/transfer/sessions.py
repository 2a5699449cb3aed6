"""What the sender and receiver sessions share: a per-endpoint inbox, a peer link, a lease,
and `Session`, the common part of `SendSession` and `RecvSession`.

`Inbox` demultiplexes one transport's control channel by transfer id: it drains
`Transport.receive()`, decodes strictly (undecodable bytes are counted and dropped, never
guessed at) and keeps each message until the session of its transfer id takes it. Messages
for a transfer nobody has opened yet wait (a reservation may arrive before the prefill
finished); `discard` drops what a closed transfer will never take.

`Link` is one session's view of its peer: it sends messages and judges where an incoming one
came from. A message is trusted only when both the transport-level source and the author
named inside it are exactly the expected peer (instance id included). The same address with
another instance id is a restarted peer (STALE: the session fails); anything else is FOREIGN
(ignored).

`Lease` is a deadline on an injectable clock. It bounds the silence of a peer, not its queue:
the peer's HOLD (it holds the transfer, waiting for compute or pool room) renews it, so a
session waits as long as its peer keeps saying so, and one lease past the last word.

`Session` holds what both sides of one transfer have: the link, the pool and its layout, the
mode, the state and the lease, and the checks every poll makes (a message from a restarted
peer, either end dead, the lease). Each side adds its own messages and moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import (
    ControlMessage,
    ControlOp,
    Message,
    decode_any,
    message_author,
)
from pdserve.transfer.peer import PeerId
from pdserve.transfer.state import TransferState, TransferStatus
from pdserve.transfer.transport import Transport

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

DEFAULT_LEASE_S = 5.0
DEFAULT_RESEND_S = 0.5


class Inbox:
    """Control messages of one transport, filed by transfer id. Lifetime: the endpoint's."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.rejected = 0  # undecodable messages dropped
        self._by_id: defaultdict[int, list[tuple[PeerId, Message]]] = defaultdict(list)

    def take(self, transfer_id: int) -> list[tuple[PeerId, Message]]:
        """Every message for `transfer_id` received so far, in arrival order; removes them."""
        self._drain()
        return self._by_id.pop(transfer_id, [])

    def peek(self, transfer_id: int) -> list[tuple[PeerId, Message]]:
        """The messages `take` would return, left in place."""
        self._drain()
        return list(self._by_id.get(transfer_id, []))

    def waiting_ids(self) -> list[int]:
        """Transfer ids with messages that no session has taken yet."""
        self._drain()
        return list(self._by_id)

    def _drain(self) -> None:
        for source, data in self.transport.receive():
            try:
                msg = decode_any(data)
            except ValueError:
                self.rejected += 1
                continue
            self._by_id[msg.transfer_id].append((source, msg))

    def discard(self, transfer_id: int) -> None:
        self._by_id.pop(transfer_id, None)


class Trust(Enum):
    TRUSTED = "trusted"
    STALE = "stale"  # same address, another instance: a restarted peer
    FOREIGN = "foreign"  # another peer altogether


@dataclass(frozen=True)
class Link:
    """One session's peer: who we are, who they are, and the shared inbox."""

    inbox: Inbox
    local: PeerId
    peer: PeerId
    transfer_id: int

    def __post_init__(self) -> None:
        if self.inbox.transport.local != self.local:
            raise ValueError(f"the transport is {self.inbox.transport.local}, not {self.local}")
        if self.local.same_address(self.peer):
            raise ValueError("a session's two ends must be different peers")

    @property
    def transport(self) -> Transport:
        return self.inbox.transport

    def send(self, msg: Message) -> None:
        self.transport.send(self.peer, msg.encode())

    def control(self, op: ControlOp, reason: str = "") -> None:
        self.send(ControlMessage(self.transfer_id, self.local, op, reason))

    def take(self) -> list[tuple[Trust, Message]]:
        return [(self.judge(src, msg), msg) for src, msg in self.inbox.take(self.transfer_id)]

    def judge(self, source: PeerId, msg: Message) -> Trust:
        author = message_author(msg)
        if source == self.peer and author == self.peer:
            return Trust.TRUSTED
        if self.peer.same_address(source) or self.peer.same_address(author):
            return Trust.STALE
        return Trust.FOREIGN

    def peer_alive(self) -> bool:
        return self.transport.peer_alive(self.peer)

    def peer_death(self) -> str:
        """Why the peer is held dead (it died, or restarted), for a session's reason."""
        return self.transport.why_dead(self.peer) or "dead"

    def self_alive(self) -> bool:
        return self.transport.peer_alive(self.local)


class Lease:
    """A deadline `seconds` after creation, or after the last `renew`, on `clock`."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        if not seconds > 0:
            raise ValueError(f"a lease lasts more than 0 seconds, got {seconds}")
        self.clock, self.seconds = clock, seconds
        self.deadline = clock() + seconds

    def renew(self) -> None:
        """The deadline is `seconds` from now (never earlier than it was)."""
        self.deadline = max(self.deadline, self.clock() + self.seconds)

    @property
    def expired(self) -> bool:
        return self.clock() >= self.deadline


class Mode(Enum):
    PUSH = "push"  # the sender writes into the receiver's pool (RDMA-WRITE shape)
    PULL = "pull"  # the receiver reads from the sender's pool (RDMA-READ shape)


class Session(ABC):
    """One side of one transfer with `peer`, over `inbox`'s transport (see `SendSession` and
    `RecvSession` for each side's life cycle).

    Invariants: the state only moves forward (`TransferStatus`); every `_fail` of a side
    fences its own moves before it tells the peer. Opening a session reaches the peer
    (`Transport.reach`), so its death or restart is known on a poll soon after, with no message
    needed. `_check_progress` fails the session when this endpoint or the peer is dead
    (`peer_role` names the peer in the reason, with the transport's why: "restarted: ..."
    when another instance took its address) or the lease expired; a message from another
    instance at the peer's address fails it too. The peer's HOLD renews the lease of a live
    session (never a terminal one): the lease times the peer's silence, not its queue.
    Lifetime: one transfer id, from its opening until the caller releases its blocks.
    """

    peer_role: str  # what the reasons call the other side: "sender" or "receiver"

    def __init__(self, inbox: Inbox, *, transfer_id: int, peer: PeerId, cache: KVCache,
                 layout: KVLayout, mode: Mode, start: TransferState, lease_s: float,
                 clock: Callable[[], float]) -> None:
        self._link = Link(inbox, inbox.transport.local, peer, transfer_id)
        self._cache, self._layout, self._mode = cache, layout, mode
        self._status = TransferStatus(start, clock)
        self._lease = Lease(lease_s, clock)
        inbox.transport.reach(peer)

    @property
    def transfer_id(self) -> int:
        return self._link.transfer_id

    @property
    def peer(self) -> PeerId:
        return self._link.peer

    @property
    def state(self) -> TransferState:
        return self._status.state

    @property
    def reason(self) -> str | None:
        return self._status.reason

    def _take_messages(self) -> None:
        """Act on every message that arrived for this transfer (a stranger's is ignored)."""
        for trust, msg in self._link.take():
            if trust is Trust.STALE:
                self._fail(f"message from another instance of the {self.peer_role}'s address "
                           "(restarted peer); not trusted")
            elif trust is not Trust.TRUSTED:
                continue
            elif isinstance(msg, ControlMessage) and msg.op is ControlOp.HOLD:
                if not self._status.is_terminal:
                    self._lease.renew()
            else:
                self._on_message(msg)

    def _check_progress(self) -> None:
        if not self._link.self_alive():
            self._fail("this endpoint is dead", tell=False)
        elif not self._link.peer_alive():
            self._fail(f"the {self.peer_role} {self._link.peer} died ({self._link.peer_death()})",
                       tell=False)
        else:
            self._check_moves()
        if not self._status.is_terminal and self._lease.expired:
            self._fail("the lease expired")

    @abstractmethod
    def _on_message(self, msg: Message) -> None:
        """A message from exactly the paired peer instance."""

    @abstractmethod
    def _check_moves(self) -> None:
        """Both ends alive: look at this side's moves."""

    @abstractmethod
    def _fail(self, reason: str, tell: bool = True) -> None:
        """Fence this side's moves, then FAILED with `reason` (told to the peer if `tell`)."""
