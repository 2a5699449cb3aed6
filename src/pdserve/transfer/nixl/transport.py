"""`Transport` over NIXL (UCX): block bytes move one-sided between registered pools, while
control messages, peer liveness and instance identity ride an embedded `TcpTransport`.

The metadata exchange format is in `meta.py`, one move and its fence in `move.py`, the remote
agents in `peers.py`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from nixl_cu12 import _api as nixl_api
from nixl_cu12 import nixl_agent, nixl_agent_config

from pdserve.transfer.link_report import LinkReport, TransferRates
from pdserve.transfer.nixl.meta import PoolRegion, agent_name, encode_meta, is_meta
from pdserve.transfer.nixl.move import NixlMove, NixlOptions, poll, quiesce, release
from pdserve.transfer.nixl.peers import Remote, RemoteAgents
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpTransport
from pdserve.transfer.transport import MoveHandle, MoveStatus, layer_span

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

log = logging.getLogger(__name__)

# nixl_cu12 logs INFO lines to stdout through a handler of its own ("nixl" logger, not
# propagating). pdserve's stdout carries results (`--json`), so NIXL's records go through the
# root logger (stderr) like ours, from WARNING up.
_nixl_log = logging.getLogger("nixl")
_nixl_log.handlers.clear()
_nixl_log.propagate = True
_nixl_log.setLevel(logging.WARNING)

__all__ = ["NixlOptions", "NixlTransport", "make_agent"]

_agent_lock = threading.Lock()


def make_agent(name: str, options: NixlOptions) -> nixl_agent:
    """A NIXL agent with the UCX backend whose progress thread (if on) sleeps up to
    `options.progress_poll_ms` between polls. `nixl_agent` builds its own `nixlAgentConfig` and
    sets `pthrDelay` (microseconds) to 0, a busy spin; the one call that receives that config,
    the binding's `nixlAgent(name, config)`, is wrapped for the duration of the constructor."""
    bindings = nixl_api.nixlBind
    construct = bindings.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = options.progress_poll_ms * 1000
        return construct(agent_name, config)

    with _agent_lock:
        bindings.nixlAgent = with_delay
        try:
            return nixl_agent(name, nixl_agent_config(
                enable_prog_thread=options.progress_thread, backends=["UCX"]))
        finally:
            bindings.nixlAgent = construct


class NixlTransport:
    """One NIXL endpoint of the transfer plane; implements `transport.Transport`.

    Life cycle.
    - Construction starts the embedded `TcpTransport` (it binds `local_host:port`; `local` is
      its PeerId) and one NIXL agent with the UCX backend, named after `local`
      (`meta.agent_name`: instance id, host and port), so a restarted peer is another agent.
    - `register(pool)` (once) registers the pool's memory ("DRAM" for CPU, "VRAM" for CUDA) and
      prepares its per-block descriptor list (one descriptor per block, index = block id).
    - First contact with a peer instance (a send, write, read or `reach` to it, or any message
      from it) sends it this endpoint's metadata once, as soon as a pool is registered. Its
      metadata, when it arrives, adds its agent and prepares its block list. Metadata messages
      never reach `receive`; a metadata message whose agent name does not match its
      authenticated TCP source is dropped with a warning.
    - Moves: `write` / `read` return a pending handle at once. The request is built from block
      ids (`make_prepped_xfer` over the two prepared lists) and posted as soon as the peer's
      metadata is known; state is advanced by `status`, `receive`, `write` and `read` (no
      thread of its own): NIXL DONE -> "done", ERR -> "error", the request released. A move
      whose peer sends no metadata within `meta_timeout_s`, or whose peer is dead for
      `dead_grace_s`, ends "error" (the NIXL request, if any, is kept until NIXL lets go).
    - Peer death is the TCP transport's verdict (`peer_alive`, `why_dead`, exact instance). A
      dead peer's agent is removed (`remove_remote_agent`) once no NIXL request to it is held.
      A restarted peer is another agent: the first authenticated contact with the new
      instance (its HELLO, or its ACK when `reach` or a move dials the instance the router
      names) makes the old one dead in the TCP transport; the old agent goes as above, pending
      moves to it end "error" within `dead_grace_s` (or when NIXL reports them), and the new
      agent is added from its own metadata.
    - `close()` (idempotent; also on leaving a `with` block) fences every move as `cancel`
      does, removes remote agents, deregisters the pool and closes the TCP transport.

    Cancel (the fence). UCX data and the TCP control channel are not ordered, so `cancel` does
    not return while NIXL may still touch memory for the move: it waits up to
    `cancel_wait_s` for NIXL to report it DONE or ERR and releases it; past that it releases
    it anyway, which makes NIXL abort it, and returns once NIXL has freed the request. If NIXL
    refuses (it cannot abort an active request), `cancel` removes the peer's agent (its UCX
    endpoints), marks the peer dead in the TCP transport (the peer then sees this endpoint's
    connections close) and logs an error; the request is retried at `close`. That last case
    is the one thing not guaranteed: it is reported, never silent. A pending move ends
    "error" after `cancel`; a move that finished before keeps its status.

    Permits: not enforced on data. A NIXL write or read is one-sided: UCX moves the bytes
    with the remote keys in our agent metadata, and no code of ours runs on this side for it,
    so `allow_writes` / `allow_reads` / `revoke` cost nothing and check nothing here. What does
    hold: our agent metadata (UCX addresses and the pool's remote keys) goes only to peer
    instances authenticated by the embedded `TcpTransport`'s bound handshake (ones this
    endpoint sends to or moves with, and ones whose authenticated messages reach it), over
    that connection (sealed with `TcpOptions.encrypt`, in the clear otherwise); a peer's
    metadata is accepted only under the agent name of its authenticated source; the embedded
    TCP endpoint registers no pool, so a WRITE or READ_REQUEST sent to it over TCP is
    refused. What does not: any peer instance holding our metadata can write or read any
    block of the registered pool, under any transfer id, until its agent is removed (it died,
    or could not be fenced) or this endpoint closes. Against a buggy or hostile holder of the
    shared secret, NIXL offers the sessions' checks only: generations and CRC32C of every
    slice before the KV is admitted (`verify.py`), nothing once it is.
    """

    def __init__(self, local_host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 instance_id: int | None = None, advertise_port: int | None = None,
                 advertise_host: str | None = None, options: NixlOptions | None = None) -> None:
        self.options = options or NixlOptions()
        # it carries control messages only: one connection to each peer is enough
        self._tcp = TcpTransport(local_host, port, secret=secret, instance_id=instance_id,
                                 advertise_port=advertise_port, advertise_host=advertise_host,
                                 options=replace(self.options.tcp, control_connection=False))
        self._name = agent_name(self._tcp.local)
        self._agent = make_agent(self._name, self.options)
        self._lock = threading.RLock()
        self._region: PoolRegion | None = None
        self._reg: Any = None
        self._prepped: Any = None
        self._remotes = RemoteAgents(self._agent)
        self._contacts: set[PeerId] = set()  # peers that have our metadata (or will)
        self._greeted: set[PeerId] = set()
        self._moves: dict[MoveHandle, NixlMove] = {}
        self._handles = itertools.count(1)
        self._inbox: list[tuple[PeerId, bytes]] = []
        self._closed = False
        self._rates = TransferRates()

    # -- Transport ---------------------------------------------------------------------------

    @property
    def local(self) -> PeerId:
        return self._tcp.local

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, pool: KVCache) -> None:
        with self._lock:
            if self._region is not None:
                raise ValueError("a NixlTransport registers one pool, once")
            region = PoolRegion.of_cache(pool)
            # NIXL holds only the address: keep the tensor alive as long as peers may touch it.
            self._pool_data = pool.data
            self._reg = self._agent.register_memory(region.reg_list(), region.mem)
            self._prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", region.block_descs(),
                                                        region.mem)
            self._region = region
            for peer in list(self._contacts):
                self._greet(peer)

    def write(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
              remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        return self._start("write", local_blocks, remote_peer, remote_blocks, layers)

    def read(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
             remote_blocks: Sequence[int]) -> MoveHandle:
        return self._start("read", local_blocks, remote_peer, remote_blocks)

    def allow_writes(self, transfer_id: int, peer: PeerId, blocks: Sequence[int],
                     layers: range | None = None) -> None:
        """Not enforced: see "Permits" in the class docstring."""

    def allow_reads(self, transfer_id: int, peer: PeerId, blocks: Sequence[int]) -> None:
        """Not enforced: see "Permits" in the class docstring."""

    def revoke(self, transfer_id: int) -> None:
        """Not enforced: see "Permits" in the class docstring."""

    def status(self, handle: MoveHandle) -> MoveStatus:
        with self._lock:
            move = self._move(handle)
            self._pump()
            return move.status

    def cancel(self, handle: MoveHandle) -> None:
        with self._lock:
            move = self._move(handle)
            move.cancelled = True
            if move.status == "pending" and move.xfer is not None and poll(self._agent, move) \
                    == "DONE" and release(self._agent, move):
                move.finish("done")  # finished before the fence: keeps "done"
            move.finish("error")
            if not quiesce(self._agent, move, self.options.cancel_wait_s):
                self._unconfirmed(move)

    def send(self, peer: PeerId, message: bytes) -> None:
        with self._lock:
            self._contact(peer)
        self._tcp.send(peer, message)

    def receive(self) -> list[tuple[PeerId, bytes]]:
        with self._lock:
            self._pump()
            out, self._inbox = self._inbox, []
        return out

    def peer_alive(self, peer: PeerId) -> bool:
        return self._tcp.peer_alive(peer)

    def why_dead(self, peer: PeerId) -> str | None:
        return self._tcp.why_dead(peer)

    def peers_lost(self) -> int:
        return self._tcp.peers_lost()

    def links(self) -> list[LinkReport]:
        """Bytes over seconds of the moves this endpoint posted (NIXL gives no RTT)."""
        return self._rates.reports()

    def _nbytes(self, move: NixlMove) -> int:
        assert self._region is not None
        first, end = move.layers or (0, self._region.num_layers)
        layer = self._region.block_nbytes // self._region.num_layers
        return len(move.local_blocks) * (end - first) * layer

    def reach(self, peer: PeerId) -> None:
        with self._lock:
            self._contact(peer)
        self._tcp.reach(peer)  # dials even before a pool is registered (no metadata yet)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for move in self._moves.values():
                move.cancelled = True
                move.finish("error")
                if not quiesce(self._agent, move, self.options.cancel_wait_s):
                    log.error("NIXL would not release move %d at close", move.handle)
            for peer in self._remotes.peers():
                self._remotes.drop(peer)
            self._release_pool()
        self._tcp.close()

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NixlTransport({self.local}, closed={self._closed})"

    # -- moves -------------------------------------------------------------------------------

    def _start(self, kind: str, local_blocks: Sequence[int], peer: PeerId,
               remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        if len(local_blocks) != len(remote_blocks) or not local_blocks:
            raise ValueError("a move needs one remote block per local block, at least one")
        with self._lock:
            if self._region is None:
                raise ValueError("register a pool before moving blocks")
            self._region.check(list(local_blocks), f"local blocks of a {kind}")
            if any(type(b) is not int or b < 0 for b in remote_blocks):
                raise ValueError("remote block ids must be non-negative integers")
            span = layer_span(layers, self._region.num_layers)
            move = NixlMove(next(self._handles), kind, peer, tuple(local_blocks),
                            tuple(remote_blocks), time.monotonic(),
                            None if layers is None else span)
            self._moves[move.handle] = move
            if self._closed or not self._tcp.peer_alive(peer):
                move.finish("error")
            else:
                self._contact(peer)
                self._pump()
            return move.handle

    def _move(self, handle: MoveHandle) -> NixlMove:
        move = self._moves.get(handle)
        if move is None:
            raise ValueError(f"move handle {handle} was not issued by this endpoint")
        return move

    def _advance(self, move: NixlMove, now: float) -> None:
        """Post a waiting move, or fold NIXL's state of a posted one into its status."""
        if move.xfer is None:
            if move.status == "pending":
                self._post(move, now)
            return
        state = poll(self._agent, move)
        if state != "PROC" and release(self._agent, move):
            done = state == "DONE" and not move.cancelled
            move.finish("done" if done else "error")
            if done and move.posted_at is not None:
                self._rates.record(f"{move.peer.host}:{move.peer.port}", self._nbytes(move),
                                   now - move.posted_at)
        elif move.dead_since is not None and now - move.dead_since > self.options.dead_grace_s:
            move.finish("error")

    def _post(self, move: NixlMove, now: float) -> None:
        remote = self._remotes.get(move.peer)
        if remote is None:
            if now - move.created > self.options.meta_timeout_s:
                log.warning("no NIXL metadata from %s; move %d fails", move.peer, move.handle)
                move.finish("error")
            return
        try:
            remote.region.check(list(move.remote_blocks), f"remote blocks of a {move.kind}")
            move.xfer = self._request(move, remote)
            move.posted_at = time.monotonic()
            if self._agent.transfer(move.xfer) == "ERR":
                raise RuntimeError("NIXL refused to post the transfer")
        except Exception as e:  # bad ids or NIXL errors fail this move only
            log.warning("%s move %d to %s failed: %s", move.kind, move.handle, move.peer, e)
            move.finish("error")
            if move.xfer is not None and not quiesce(self._agent, move, 0.0):
                self._unconfirmed(move)

    def _request(self, move: NixlMove, remote: Remote) -> Any:
        """The NIXL request of a move: whole blocks from the prepared lists, or the layer
        slices of each block as descriptors made for this move."""
        if move.layers is None:
            return self._agent.make_prepped_xfer(
                move.kind.upper(), self._prepped, list(move.local_blocks), remote.prepped,
                list(move.remote_blocks))
        assert self._region is not None
        mem = self._region.mem
        local = self._agent.get_xfer_descs(
            self._region.layer_descs(move.local_blocks, *move.layers), mem)
        theirs = self._agent.get_xfer_descs(
            remote.region.layer_descs(move.remote_blocks, *move.layers), remote.region.mem)
        return self._agent.initialize_xfer(move.kind.upper(), local, theirs, remote.agent)

    def _unconfirmed(self, move: NixlMove) -> None:
        """The fence could not be confirmed: cut this endpoint off from the peer for good."""
        log.error("NIXL cannot confirm move %d to %s stopped; dropping that peer",
                  move.handle, move.peer)
        self._tcp.peer_died(move.peer, f"NIXL move {move.handle} could not be fenced")
        self._remotes.drop(move.peer, force=True)

    # -- pumping: control messages, metadata, liveness ---------------------------------------

    def _pump(self) -> None:
        """Take what the TCP transport received, then advance every unfinished move. Caller
        holds the lock."""
        if self._closed:
            return
        for peer, message in self._tcp.receive():
            self._contact(peer)
            if is_meta(message):
                self._remotes.add(peer, message)
            else:
                self._inbox.append((peer, message))
        now = time.monotonic()
        for peer in [p for p in self._remotes.peers() if not self._tcp.peer_alive(p)]:
            self._on_dead(peer, now)
        for move in self._moves.values():
            if move.xfer is not None or move.status == "pending":
                if move.dead_since is None and not self._tcp.peer_alive(move.peer):
                    move.dead_since = now
                self._advance(move, now)

    def _contact(self, peer: PeerId) -> None:
        if peer != self.local and peer not in self._contacts:
            self._contacts.add(peer)
            self._greet(peer)

    def _greet(self, peer: PeerId) -> None:
        if self._region is None or peer in self._greeted or self._closed:
            return
        self._greeted.add(peer)
        meta = encode_meta(self._name, self._region, self._agent.get_agent_metadata())
        self._tcp.send(peer, meta)

    def _on_dead(self, peer: PeerId, now: float) -> None:
        """Drop a dead peer's agent once no NIXL request to it is held."""
        moves = [m for m in self._moves.values() if m.peer == peer]
        for move in moves:
            if move.dead_since is None:
                move.dead_since = now
            self._advance(move, now)
        if all(m.xfer is None for m in moves):
            self._remotes.drop(peer)

    def _release_pool(self) -> None:
        try:
            if self._prepped is not None:
                self._agent.release_dlist_handle(self._prepped)
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
        except Exception as e:
            log.warning("releasing the NIXL registration failed: %s", e)
        self._prepped = self._reg = None
