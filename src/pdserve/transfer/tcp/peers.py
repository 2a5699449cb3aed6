"""The TCP endpoint's table of peer instances: which are alive, and the one place a peer dies.

An instance is alive until it is declared dead or the endpoint closes. An instance not met yet
is alive too, so that the one the router names after a restart is dialed; the bound handshake
then settles who answers at that address. The instance that last proved itself there with a
bound greeting is the one there, and the one before it is dead (it restarted). `TcpTransport`'s
docstring lists what may declare a peer dead. When one dies, each `PeerHolder` handed to `hold`
lets go of what it holds for that peer (its moves fail, its connections close), in the order
given.

Two kinds of death:
- for good: it restarted (another instance proved itself at its address), it broke the
  protocol or a sealed record's tag, or this endpoint could not fence a move to it. Its
  messages are refused from then on (a restarted peer's stale ones above all).
- lost: its connection ended, was reset (keepalive: a host that stopped answering, a network
  partition) or could not be made. The process may well be alive behind a link that comes
  back, so it is dead only until it proves itself again with a bound greeting, or until
  `LOST_RETRY_S` have passed, when new work names it and dials it again (a failed dial makes
  it lost once more). Everything held for it was dropped at its death, on both sides (each
  side's own connection ends), so a revived instance starts with no move in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.transfer.auth import PeerRefused
from pdserve.transfer.peer import PeerId, restarted

log = logging.getLogger(__name__)

# A lost peer is taken as dead this long: legs naming it end at once (their decode side
# recomputes) instead of each waiting for a dial to a host that does not answer.
LOST_RETRY_S = 5.0


class PeerHolder(Protocol):
    """Something that holds moves, threads or connections for peer instances."""

    def drop_peer(self, peer: PeerId) -> None:
        """`peer` is dead: end what is held for it. Never calls back into the table's lock."""


class PeerTable:
    """Alive and dead peer instances of one endpoint (`local` is always alive until `close`).
    Thread-safe. Lifetime: the endpoint's."""

    def __init__(self, local: PeerId, clock: Callable[[], float] = time.monotonic) -> None:
        self.local, self._clock = local, clock
        self._lock = threading.Lock()
        self._current: dict[tuple[str, int], int] = {}  # address -> last proved there
        self._dead: dict[PeerId, str] = {}  # -> why
        self._lost: dict[PeerId, float] = {}  # dead but lost: -> when it may be dialed again
        self._holders: tuple[PeerHolder, ...] = ()
        self._closed = False

    def hold(self, *holders: PeerHolder) -> None:
        """Who is told, in this order, when a peer dies (set once, at the endpoint's start)."""
        self._holders = holders

    @property
    def closed(self) -> bool:
        return self._closed

    def alive(self, peer: PeerId) -> bool:
        return self.why_dead(peer) is None

    def why_dead(self, peer: PeerId) -> str | None:
        """None while `peer` is alive (met or not, or lost longer than `LOST_RETRY_S` ago);
        else why it is held dead."""
        with self._lock:
            if self._closed:
                return "this endpoint is closed"
            if peer in self._lost and self._clock() >= self._lost[peer]:
                self._revive(peer, "it may be reachable again")
            return None if peer == self.local else self._dead.get(peer)

    def lost_now(self) -> int:
        """Lost instances not yet due to be dialed again."""
        with self._lock:
            now = self._clock()
            return sum(1 for retry_at in self._lost.values() if now < retry_at)

    def seen(self, peer: PeerId) -> None:
        """`peer` proved itself with a bound greeting (its HELLO to us, or its HELLO_ACK to our
        HELLO); the instance that proved itself at that address before is dead (restarted).
        A lost instance is alive again. PeerRefused for one dead for good."""
        with self._lock:
            if peer in self._lost:
                self._revive(peer, "it greeted us again")
            if peer in self._dead:
                raise PeerRefused(f"instance {peer.instance_id:016x} is known dead")
            addr = (peer.host, peer.port)
            old = self._current.get(addr)
            self._current[addr] = peer.instance_id
        if old is not None and old != peer.instance_id:
            self.died(PeerId(old, *addr), restarted(peer))

    def died(self, peer: PeerId, why: str, lost: bool = False) -> None:
        """Mark that instance dead (`lost`: until it may be reached again, see above; else for
        good), then let every holder drop it (once per death). A lost instance that dies for
        good stays dead."""
        with self._lock:
            if self._closed or (peer in self._dead and (lost or peer not in self._lost)):
                return
            if peer in self._dead:  # lost, now dead for good: its holders let go already
                del self._lost[peer]
                self._dead[peer] = why
                return
            self._dead[peer] = why
            if lost:
                self._lost[peer] = self._clock() + LOST_RETRY_S
        log.warning("peer %s is %s: %s", peer, "lost" if lost else "dead", why)
        for holder in self._holders:
            holder.drop_peer(peer)

    def _revive(self, peer: PeerId, why: str) -> None:
        """Under the lock: a lost instance is alive again."""
        del self._lost[peer], self._dead[peer]
        log.info("peer %s is alive again: %s", peer, why)

    def close(self) -> bool:
        """The endpoint closes: nobody is alive any more. False if it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True
