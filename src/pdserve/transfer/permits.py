"""Which peer may write into or read from which local blocks, per transfer: the target's check
on the moves a peer starts (`Transport.allow_writes` / `allow_reads` / `revoke`).

A permit names one transfer id, one peer instance (PeerId equality: instance id, host and
port) and exactly the local blocks it covers (a write permit also its layers). A move is
allowed only when its transfer id, its authenticated origin, every block id and its layer
range fall inside one permit of its kind; anything else is refused whole (no block of it
lands). The sessions grant them: `RecvSession` the reserved destination blocks of a push to
its sender, when it sends the Reservation; `SendSession` the held source blocks of a pull to
its reader, when it sends the descriptor; each revokes when it ends, on every terminal path.

Invariant (kept by the sessions): a permit exists only while its blocks are reserved or held
for its transfer, so whenever a permitted write lands, the generations the Reservation named
are still current.

Fence: a move that passed its check `use`s the permit until `done` (one frame landing or
going out), and `revoke(transfer_id, wait_s)` waits up to `wait_s` for the uses of that
transfer to end. Once it returns with nothing still in use, no byte of the permit's blocks is
touched for that transfer again, whatever order the peer's frames and messages arrive in; the
holders of uses that outlast the wait are returned, for the caller to cut off.

Revoked transfer ids are remembered with their peers (the newest `REMEMBER` ids), so that a
late move of the permit's own peer (bytes that were on the wire when its transfer ended) is
refused as late, quietly, rather than reported as a stray.
Thread-safe. Lifetime: one per endpoint.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from pdserve.transfer.peer import PeerId

Kind = Literal["write", "read"]
REMEMBER = 4096


@dataclass(frozen=True)
class Permit:
    peer: PeerId
    blocks: frozenset[int]
    layers: range | None  # a write's layers; None: every layer


@dataclass(frozen=True)
class Refusal:
    """Why a move is not permitted; `late` when its transfer ended and it comes from the peer
    that held the permit (not a stray: a move already under way when the transfer ended)."""

    reason: str
    late: bool


class Permits:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._live: dict[tuple[int, Kind], Permit] = {}
        self._ended: OrderedDict[int, frozenset[PeerId]] = OrderedDict()
        self._uses: dict[int, Counter[Hashable]] = {}  # transfer id -> holder -> uses

    def allow(self, kind: Kind, transfer_id: int, peer: PeerId, blocks: Sequence[int],
              layers: range | None = None) -> None:
        """Permit `peer` to `kind` exactly `blocks` (and `layers`) under `transfer_id`,
        replacing that transfer's earlier permit of the same kind."""
        ids = list(blocks)
        if not ids or len(set(ids)) != len(ids) or any(type(b) is not int or b < 0 for b in ids):
            raise ValueError("a permit names distinct non-negative block ids, at least one")
        if layers is not None and (layers.step != 1 or not 0 <= layers.start < layers.stop):
            raise ValueError(f"a permit's layers are a non-empty step-1 range, got {layers!r}")
        with self._lock:
            self._live[(transfer_id, kind)] = Permit(peer, frozenset(ids), layers)

    def revoke(self, transfer_id: int, wait_s: float = 0.0) -> list[Hashable]:
        """End every permit of `transfer_id` (idempotent), then wait up to `wait_s` for its
        uses to end; the holders of those still in use (none: the fence holds)."""
        with self._lock:
            peers = {p.peer for k in ("write", "read")
                     if (p := self._live.pop((transfer_id, k), None)) is not None}
            if peers:
                self._ended[transfer_id] = self._ended.get(transfer_id, frozenset()) | peers
                self._ended.move_to_end(transfer_id)
                while len(self._ended) > REMEMBER:
                    self._ended.popitem(last=False)
            self._lock.wait_for(lambda: transfer_id not in self._uses, wait_s)
            return list(self._uses.get(transfer_id, ()))

    def use(self, kind: Kind, transfer_id: int, peer: PeerId, blocks: Sequence[int],
            layers: tuple[int, int], holder: Hashable) -> Refusal | None:
        """`refusal`, and when there is none, one use of the permit by `holder` until `done`."""
        with self._lock:
            refusal = self.refusal(kind, transfer_id, peer, blocks, layers)
            if refusal is None:
                self._uses.setdefault(transfer_id, Counter())[holder] += 1
            return refusal

    def done(self, transfer_id: int, holder: Hashable) -> None:
        """One use by `holder` ended."""
        with self._lock:
            uses = self._uses[transfer_id]
            uses[holder] -= 1
            if uses[holder] <= 0:
                del uses[holder]
            if not uses:
                del self._uses[transfer_id]
                self._lock.notify_all()

    def refusal(self, kind: Kind, transfer_id: int, peer: PeerId, blocks: Sequence[int],
                layers: tuple[int, int]) -> Refusal | None:
        """None when `peer` may `kind` `blocks` (layers [first, end)) under `transfer_id`."""
        with self._lock:
            permit = self._live.get((transfer_id, kind))
            late = peer in self._ended.get(transfer_id, frozenset())
        if permit is None:
            why = "ended" if late else f"has no {kind} permit here"
            return Refusal(f"not permitted: transfer {transfer_id:x} {why}", late)
        if permit.peer != peer:
            return Refusal(f"not permitted: transfer {transfer_id:x} permits another peer", False)
        if not permit.blocks.issuperset(blocks):
            return Refusal(f"not permitted: blocks outside transfer {transfer_id:x}'s permit",
                           False)
        first, end = layers
        if permit.layers is not None and not (permit.layers.start <= first
                                              and end <= permit.layers.stop):
            return Refusal(f"not permitted: layers [{first}, {end}) outside transfer "
                           f"{transfer_id:x}'s permit", False)
        return None
