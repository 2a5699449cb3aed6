"""In-process transport for tests: endpoints on one `FakeFabric`, moves copy between pools.

Time comes from the fabric's clock (inject a fake one to keep tests fast). Moves and messages
land when the fabric makes progress (any endpoint's `status`, `receive` or `peer_alive`) and
their due time has come; a move copies its bytes at that moment, as a late one-sided write
would.

Faults (`Fault`), each for one transfer id or every transfer (`transfer_id=None`), applied at
most `times` times (None: always):
- drop: a move stays pending forever (until cancelled), or a message is never delivered;
- delay: a move or message lands `seconds` late;
- corrupt: after a move lands, one byte of its first destination block is flipped;
- die: when a move of the transfer starts, endpoint `peer` dies (also `FakeFabric.kill`):
  its messages are lost both ways and every move to or from it ends in "error".
`message` narrows a message fault to one kind (`messages.message_kind`: "notice", "abort"...).

Permits hold as in a real transport (`permits.py`): when a move lands, the target endpoint
(a write's destination, a read's holder) must hold a permit for it, else the move ends in
"error" and copies nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.transfer.link_report import LinkReport
from pdserve.transfer.messages import decode_any, message_kind
from pdserve.transfer.peer import PeerId, restarted
from pdserve.transfer.permits import Kind, Permits
from pdserve.transfer.transport import MoveHandle, MoveStatus, layer_span

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

_KINDS = ("drop", "delay", "corrupt", "die")
_TARGETS = ("data", "message")


@dataclass(frozen=True)
class Fault:
    """One injected fault; see the module docstring for what each kind does."""

    kind: str
    transfer_id: int | None = None
    target: str = "data"
    message: str | None = None
    seconds: float = 0.0
    times: int | None = None
    peer: PeerId | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS or self.target not in _TARGETS:
            raise ValueError(f"kind must be one of {_KINDS}, target one of {_TARGETS}")
        if self.kind in ("corrupt", "die") and self.target != "data":
            raise ValueError(f"{self.kind} applies to data moves only")
        if (self.kind == "die") != (self.peer is not None):
            raise ValueError("name the dying `peer` exactly for a die fault")
        if self.message is not None and self.target != "message":
            raise ValueError("`message` narrows message faults only")
        if self.kind == "delay" and not self.seconds > 0:
            raise ValueError(f"a delay needs seconds > 0, got {self.seconds}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"times must be >= 1 or None, got {self.times}")

    def matches(self, target: str, transfer_id: int, message: str | None = None) -> bool:
        return (self.target == target
                and self.transfer_id in (None, transfer_id)
                and self.message in (None, message))


@dataclass
class _Move:
    kind: Kind
    transfer_id: int
    src: PeerId
    src_blocks: tuple[int, ...]
    dst: PeerId
    dst_blocks: tuple[int, ...]
    due: float | None  # None: dropped, never lands
    corrupt: bool
    layers: slice | None = None  # None: every layer
    status: MoveStatus = "pending"


@dataclass
class _Envelope:
    src: PeerId
    data: bytes
    due: float


class FakeFabric:
    """Registry of `FakeTransport` endpoints keyed by PeerId (instance included).

    Lifetime: one per test; endpoints live until `kill`. A killed instance never comes back;
    `restart` registers a new instance at the same address.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._pools: dict[PeerId, KVCache | None] = {}
        self._inboxes: dict[PeerId, list[_Envelope]] = {}
        self._dead: dict[PeerId, str] = {}  # -> why
        self._moves: dict[MoveHandle, _Move] = {}
        self._permits: dict[PeerId, Permits] = {}
        self._faults: list[list] = []  # [Fault, remaining uses or None]
        self._handles = itertools.count(1)
        self._instances = itertools.count(0xF000)

    # -- endpoints and faults ------------------------------------------------------------------

    def endpoint(self, peer: PeerId) -> FakeTransport:
        if peer in self._pools or peer in self._dead:
            raise ValueError(f"{peer} is already on this fabric")
        self._pools[peer] = None
        self._inboxes[peer] = []
        self._permits[peer] = Permits()
        return FakeTransport(self, peer)

    def permits(self, peer: PeerId) -> Permits:
        return self._permits[peer]

    def kill(self, peer: PeerId, why: str = "killed") -> None:
        """`peer` disappears: queued messages to it are lost, its moves end in error."""
        self._dead.setdefault(peer, why)
        self._pools.pop(peer, None)
        self._inboxes.pop(peer, None)
        for move in self._moves.values():
            if move.status == "pending" and peer in (move.src, move.dst):
                move.status = "error"

    def attach(self, peer: PeerId, pool: KVCache) -> None:
        if peer not in self._pools:
            raise ValueError(f"{peer} is dead or not on this fabric")
        self._pools[peer] = pool

    def restart(self, peer: PeerId) -> FakeTransport:
        """Kill `peer` and bring up a new instance at the same address (every endpoint knows
        at once, as a real one does at its first contact with the new instance)."""
        new = PeerId(next(self._instances), peer.host, peer.port)
        self.kill(peer, restarted(new))
        return self.endpoint(new)

    def inject(self, fault: Fault) -> None:
        self._faults.append([fault, fault.times])

    def alive(self, peer: PeerId) -> bool:
        self.progress()
        return peer in self._pools

    def why_dead(self, peer: PeerId) -> str | None:
        if self.alive(peer):
            return None
        return self._dead.get(peer, "not on this fabric")

    def _take_fault(self, kind: str, target: str, tid: int, msg: str | None = None) -> Fault | None:
        for entry in self._faults:
            fault, left = entry
            if fault.kind == kind and left != 0 and fault.matches(target, tid, msg):
                entry[1] = None if left is None else left - 1
                return fault
        return None

    # -- moves ---------------------------------------------------------------------------------

    def start_move(self, kind: Kind, tid: int, src: PeerId, src_blocks: Sequence[int],
                   dst: PeerId, dst_blocks: Sequence[int],
                   layers: range | None = None) -> MoveHandle:
        if len(src_blocks) != len(dst_blocks) or not src_blocks:
            raise ValueError("a move needs one destination per source block, at least one")
        pool = self._pools.get(src) or self._pools.get(dst)
        span = layer_span(layers, pool.num_layers) if pool is not None else (0, 0)
        delay = self._take_fault("delay", "data", tid)
        due = None if self._take_fault("drop", "data", tid) else (
            self.clock() + (delay.seconds if delay else 0.0))
        corrupt = self._take_fault("corrupt", "data", tid) is not None
        handle = next(self._handles)
        self._moves[handle] = _Move(kind, tid, src, tuple(src_blocks), dst, tuple(dst_blocks),
                                    due, corrupt, None if layers is None else slice(*span))
        if src in self._dead or dst in self._dead or src not in self._pools \
                or dst not in self._pools:
            self._moves[handle].status = "error"
        die = self._take_fault("die", "data", tid)
        if die is not None:
            self.kill(die.peer)
        return handle

    def move_status(self, handle: MoveHandle) -> MoveStatus:
        self.progress()
        return self._moves[handle].status

    def cancel(self, handle: MoveHandle) -> None:
        move = self._moves[handle]
        if move.status == "pending":
            move.status = "error"

    def progress(self) -> None:
        """Land every pending move whose time has come."""
        now = self.clock()
        for move in self._moves.values():
            if move.status == "pending" and move.due is not None and move.due <= now:
                self._land(move)

    def _land(self, move: _Move) -> None:
        src, dst = self._pools.get(move.src), self._pools.get(move.dst)
        if src is None or dst is None or not self._permitted(move, dst.num_layers):
            move.status = "error"
            return
        layers = move.layers or slice(None)
        dst.copy_blocks_from(src, list(move.src_blocks), list(move.dst_blocks), layers)
        if move.corrupt:
            flat = dst.data[move.dst_blocks[0], layers].reshape(-1).view(torch.uint8)
            flat[flat.numel() // 2] ^= 0x5A
        move.status = "done"

    def _permitted(self, move: _Move, num_layers: int) -> bool:
        """The target (a write's destination, a read's holder) holds a permit for `move`."""
        span = (0, num_layers) if move.layers is None else (move.layers.start, move.layers.stop)
        if move.kind == "write":
            target, origin, blocks = move.dst, move.src, move.dst_blocks
        else:
            target, origin, blocks = move.src, move.dst, move.src_blocks
        return self._permits[target].refusal(move.kind, move.transfer_id, origin, blocks,
                                             span) is None

    # -- messages ------------------------------------------------------------------------------

    def post(self, src: PeerId, dst: PeerId, data: bytes) -> None:
        if src in self._dead or dst not in self._inboxes:
            return
        tid, kind = _classify(data)
        if self._take_fault("drop", "message", tid, kind):
            return
        delay = self._take_fault("delay", "message", tid, kind)
        due = self.clock() + (delay.seconds if delay else 0.0)
        self._inboxes[dst].append(_Envelope(src, bytes(data), due))

    def deliver(self, dst: PeerId) -> list[tuple[PeerId, bytes]]:
        self.progress()
        inbox = self._inboxes.get(dst)
        if inbox is None:
            return []
        now = self.clock()
        ready = [e for e in inbox if e.due <= now]
        inbox[:] = [e for e in inbox if e.due > now]
        return [(e.src, e.data) for e in ready]


def _classify(data: bytes) -> tuple[int, str | None]:
    """(transfer id, message kind) for fault matching; (-1, None) when undecodable."""
    try:
        msg = decode_any(data)
    except ValueError:
        return -1, None
    return msg.transfer_id, message_kind(msg)


class FakeTransport:
    """One endpoint on a `FakeFabric`; implements `transport.Transport`.

    Lifetime: from `FakeFabric.endpoint` until the fabric kills it; afterwards sends are lost,
    `receive` returns nothing and new moves end in "error".
    """

    def __init__(self, fabric: FakeFabric, local: PeerId) -> None:
        self._fabric = fabric
        self._local = local
        self._handles: set[MoveHandle] = set()

    @property
    def local(self) -> PeerId:
        return self._local

    def register(self, pool: KVCache) -> None:
        self._fabric.attach(self._local, pool)

    def write(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
              remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        return self._own(self._fabric.start_move("write", transfer_id, self._local,
                                                 local_blocks, remote_peer, remote_blocks,
                                                 layers))

    def read(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
             remote_blocks: Sequence[int]) -> MoveHandle:
        return self._own(self._fabric.start_move("read", transfer_id, remote_peer,
                                                 remote_blocks, self._local, local_blocks))

    def allow_writes(self, transfer_id: int, peer: PeerId, blocks: Sequence[int],
                     layers: range | None = None) -> None:
        self._fabric.permits(self._local).allow("write", transfer_id, peer, blocks, layers)

    def allow_reads(self, transfer_id: int, peer: PeerId, blocks: Sequence[int]) -> None:
        self._fabric.permits(self._local).allow("read", transfer_id, peer, blocks)

    def revoke(self, transfer_id: int) -> None:
        self._fabric.permits(self._local).revoke(transfer_id)

    def status(self, handle: MoveHandle) -> MoveStatus:
        self._check(handle)
        return self._fabric.move_status(handle)

    def cancel(self, handle: MoveHandle) -> None:
        self._check(handle)
        self._fabric.cancel(handle)

    def send(self, peer: PeerId, message: bytes) -> None:
        self._fabric.post(self._local, peer, message)

    def receive(self) -> list[tuple[PeerId, bytes]]:
        return self._fabric.deliver(self._local)

    def peer_alive(self, peer: PeerId) -> bool:
        return self._fabric.alive(peer)

    def why_dead(self, peer: PeerId) -> str | None:
        return self._fabric.why_dead(peer)

    def peers_lost(self) -> int:
        """Always 0: the fabric knows every death at once, and a death is for good."""
        return 0

    def links(self) -> list[LinkReport]:
        """Nothing measured: the fabric moves bytes in memory."""
        return []

    def reach(self, peer: PeerId) -> None:
        """Nothing to dial: the fabric knows every death at once."""

    def _own(self, handle: MoveHandle) -> MoveHandle:
        self._handles.add(handle)
        return handle

    def _check(self, handle: MoveHandle) -> None:
        if handle not in self._handles:
            raise ValueError(f"move handle {handle} was not issued by this endpoint")
