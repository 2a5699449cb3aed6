"""The TCP endpoint's table of peer instances: which are alive, and the one place a peer dies.

An instance is alive until it is declared dead (for good: a new instance at its address is
another peer) or the endpoint closes. An instance not met yet is alive too, so that the one
the router names after a restart is dialed; the bound handshake then settles who answers at
that address. The instance that last proved itself there with a bound greeting is the one
there, and the one before it is dead (it restarted). `TcpTransport`'s docstring lists what may
declare a peer dead. When one dies, each `PeerHolder` handed to `hold` lets go of what it holds
for that peer (its moves fail, its connections close), in the order given.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from pdserve.transfer.auth import PeerRefused
from pdserve.transfer.peer import PeerId, restarted

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
        self._current: dict[tuple[str, int], int] = {}  # address -> last proved there
        self._dead: dict[PeerId, str] = {}  # -> why
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
        """None while `peer` is alive (met or not); else why it is held dead."""
        with self._lock:
            if self._closed:
                return "this endpoint is closed"
            return None if peer == self.local else self._dead.get(peer)

    def seen(self, peer: PeerId) -> None:
        """`peer` proved itself with a bound greeting (its HELLO to us, or its HELLO_ACK to our
        HELLO); the instance that proved itself at that address before is dead (restarted).
        PeerRefused for one known dead."""
        with self._lock:
            if peer in self._dead:
                raise PeerRefused(f"instance {peer.instance_id:016x} is known dead")
            addr = (peer.host, peer.port)
            old = self._current.get(addr)
            self._current[addr] = peer.instance_id
        if old is not None and old != peer.instance_id:
            self.died(PeerId(old, *addr), restarted(peer))

    def died(self, peer: PeerId, why: str) -> None:
        """Mark that instance dead for good, then let every holder drop it (once)."""
        with self._lock:
            if peer in self._dead or self._closed:
                return
            self._dead[peer] = why
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
