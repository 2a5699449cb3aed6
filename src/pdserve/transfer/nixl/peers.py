"""The remote side of a NIXL endpoint: one added agent and prepared block list per peer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pdserve.transfer.nixl.meta import PoolRegion, agent_name, decode_meta
from pdserve.transfer.peer import PeerId

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Remote:
    """A peer instance whose metadata arrived: its agent name, pool and prepared block list
    (descriptor i = its block i)."""

    agent: str
    region: PoolRegion
    prepped: Any


class RemoteAgents:
    """The remote agents one local NIXL agent knows, by exact peer instance.

    Invariants: a peer is added at most once (later metadata from it is ignored), only from
    metadata that names that peer's own agent (`agent_name(peer)`, peer = the authenticated
    TCP source), and `drop` releases the prepared list before removing the agent. Not
    thread-safe: the transport calls it under its lock."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._remotes: dict[PeerId, Remote] = {}

    def get(self, peer: PeerId) -> Remote | None:
        return self._remotes.get(peer)

    def peers(self) -> list[PeerId]:
        return list(self._remotes)

    def add(self, peer: PeerId, message: bytes) -> None:
        """Add `peer`'s agent from its metadata message; a bad one is logged and dropped."""
        try:
            name, region, md = decode_meta(message)
            if name != agent_name(peer):
                raise ValueError(f"it names agent {name!r}")
        except ValueError as e:
            log.warning("dropping NIXL metadata from %s: %s", peer, e)
            return
        if peer in self._remotes:
            return
        try:
            added = self._agent.add_remote_agent(md)
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                raise ValueError(f"metadata is for agent {added!r}, not {name!r}")
            prepped = self._agent.prep_xfer_dlist(name, region.block_descs(), region.mem)
        except Exception as e:
            log.warning("cannot add the NIXL agent of %s: %s", peer, e)
            return
        self._remotes[peer] = Remote(name, region, prepped)

    def drop(self, peer: PeerId, force: bool = False) -> None:
        """Forget `peer`: release its block list and remove its agent (its UCX endpoints)."""
        remote = self._remotes.pop(peer, None)
        if remote is None:
            return
        try:
            self._agent.release_dlist_handle(remote.prepped)
            self._agent.remove_remote_agent(remote.agent)
        except Exception as e:
            (log.error if force else log.warning)("removing NIXL agent %s: %s", remote.agent, e)
