"""The TCP endpoint's table of peer instances: which are alive, and the one place a peer dies.

An instance is alive until it is declared dead (for good: a new instance at its address is
another peer) or the endpoint closes; a newer instance seen at its address is the newest one
there, and an older one at that address is dead (it restarted). `TcpTransport`'s docstring
lists what may declare a peer dead. When one dies, each `PeerHolder` handed to `hold` lets go
of what it holds for that peer (its moves fail, its connections close), in the order given.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from pdserve.transfer.auth import PeerRefused
from pdserve.transfer.peer import PeerId

log = logging.getLogger(__name__)


class PeerHolder(Protocol):
    """Something that holds moves, threads or connections for peer instances."""

    def drop_peer(self, peer: PeerId) -> None:
        """`peer` is dead: end what is held for it. Never calls back into the table's lock."""


class PeerTable:
    """Alive and dead peer instances of one endpoint (`local` is always alive until `close`).
    Thread-safe. Lifetime: the endpoint's."""

    def __init__(self, local: PeerId) -> None:
        self.local = local
        self._lock = threading.Lock()
        self._current: dict[tuple[str, int], int] = {}  # address -> newest instance seen
        self._dead: set[PeerId] = set()
        self._holders: tuple[PeerHolder, ...] = ()
        self._closed = False

    def hold(self, *holders: PeerHolder) -> None:
        """Who is told, in this order, when a peer dies (set once, at the endpoint's start)."""
        self._holders = holders

    @property
    def closed(self) -> bool:
        return self._closed

    def alive(self, peer: PeerId) -> bool:
        with self._lock:
            if self._closed:
                return False
            if peer == self.local:
                return True
            current = self._current.get((peer.host, peer.port), peer.instance_id)
            return peer not in self._dead and current == peer.instance_id

    def seen(self, peer: PeerId) -> None:
        """`peer` proved itself with a bound greeting (its HELLO to us, or its HELLO_ACK to our
        HELLO); an older instance at its address is dead. PeerRefused for one known dead."""
        with self._lock:
            if peer in self._dead:
                raise PeerRefused(f"instance {peer.instance_id:016x} is known dead")
            addr = (peer.host, peer.port)
            old = self._current.get(addr)
            self._current[addr] = peer.instance_id
        if old is not None and old != peer.instance_id:
            self.died(PeerId(old, *addr), f"restarted as {peer.instance_id:016x}")

    def died(self, peer: PeerId, why: str) -> None:
        """Mark that instance dead for good, then let every holder drop it (once)."""
        with self._lock:
            if peer in self._dead or self._closed:
                return
            self._dead.add(peer)
        log.warning("peer %s is dead: %s", peer, why)
        for holder in self._holders:
            holder.drop_peer(peer)

    def close(self) -> bool:
        """The endpoint closes: nobody is alive any more. False if it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True
