"""`TcpTransport`: one TCP endpoint of the transfer plane, composed of its parts.

    options.py       TcpOptions: timeouts and limits
    frames.py        the frame format and zero-copy socket helpers
    hello.py         the handshake's messages; handshake.py both sides of the bound handshake
    wire.py          frame I/O on one connection, plain or sealed (AES-256-GCM)
    pool.py          the registered pool and the permits that guard it (`PoolGate`)
    moves.py         this endpoint's moves and their fence (`MoveTable`)
    peers.py         which peer instances are alive; where a peer dies (`PeerTable`)
    send_side.py     one outgoing connection and queue per peer (`SendSide`, `PeerSender`)
    receive_side.py  the accept loop and one reader per connection (`ReceiveSide`), with
                     incoming_share.py: equal receive windows for peers sending at once

The parts share no owner: each is given the parts it uses when it is made, and the peer table
tells the moves, the send side and the receive side (in that order) when a peer dies. This
class makes them, implements `transport.Transport` over them, and closes them.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.auth import HandshakeAuth
from pdserve.transfer.link_report import LinkReport
from pdserve.transfer.peer import PeerId, process_instance_id
from pdserve.transfer.tcp.frames import ProtocolError
from pdserve.transfer.tcp.handshake import BoundHandshake
from pdserve.transfer.tcp.moves import MoveTable
from pdserve.transfer.tcp.options import TcpOptions
from pdserve.transfer.tcp.peers import PeerTable
from pdserve.transfer.tcp.pool import PoolGate
from pdserve.transfer.tcp.receive_side import ReceiveSide
from pdserve.transfer.tcp.send_side import SendSide
from pdserve.transfer.transport import MoveHandle, MoveStatus, layer_span

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

log = logging.getLogger(__name__)


class TcpTransport:
    """One TCP endpoint of the transfer plane; implements `transport.Transport`.

    Life cycle.
    - Construction binds and listens on `local_host:port` (0: a free port) and starts one daemon
      accept thread. `local` is this instance: `instance_id` (default: the process's) at the
      advertised address (`advertise_host`, default: `local_host`, the address peers dial
      when this endpoint binds a wildcard or another host's view differs;
      `advertise_port`, default: the real port; tests use it to simulate a restarted peer at
      the same address).
    - Incoming: at most `max_connections` accepted connections at a time (one more is closed at
      once; a peer holds two), each with one daemon reader thread. It first expects, within
      `handshake_timeout_s` of the accept, a HELLO (`hello.py`) signed with the shared secret
      (`HandshakeAuth`) and addressed to exactly `local`; a bad signature, a replay, another
      kind of greeting, a HELLO addressed elsewhere (relayed), a malformed PeerId, an
      instance known dead or the deadline closes the connection with a rate-limited warning
      naming the remote address.
      A HELLO for another instance at this address (the dialer has not learnt of a restart)
      gets a signed HELLO_ACK first, so the dialer learns it, and is refused the same way. The
      reader answers a signed HELLO_ACK bound to that HELLO, then processes frames strictly in
      order; WRITE bytes land in the pool with recv_into the block's memory (no staging).
    - Permits (`permits.py`): a WRITE lands only inside a write permit of its transfer id for
      the connection's authenticated peer (every block id, its layers); a READ_REQUEST is
      served only inside a read permit, checked again as each READ_DATA frame goes out (once
      it is not, the rest of the read is answered READ_ERROR and the read fails). Anything
      else is drained without touching the pool and answered WRITE_ERROR / READ_ERROR "not
      permitted" (a rate-limited warning; a late move of the permit's own peer after `revoke`
      only a debug line). A refusal never ends the connection or marks anyone dead. `revoke`
      is a fence: it waits for a frame of the transfer still landing or going out (up to
      `cancel_wait_s`, then shuts that connection down), so once it returns no byte of the
      transfer touches the pool, in whatever order the peer's frames and messages arrive.
    - Outgoing: frames to a peer instance travel on two connections this endpoint dials lazily
      (first use of each, or both at `reach`): control messages, answers and read requests
      on one, WRITE and READ_DATA frames on the other (`TcpOptions.control_connection`; off:
      both on one), each fed by its own `PeerSender` queue and thread (`send_side.py`), so
      `send`, `write`, `read` and `reach` never block. Dialing waits at most
      `dial_timeout_s`.
    - Peer death marks that exact instance dead: `peer_alive` is False (`why_dead` says why),
      its pending moves end in "error", messages to it are dropped; a new instance at the
      address is a different peer. A death by a lost link (EOF, a reset, a failed send or
      dial, a connection closed before any HELLO_ACK) lasts until the instance greets us
      again or `peers.LOST_RETRY_S` pass (a partition heals, `peers.py`); any other is for
      good. An instance not met yet is alive: the one the
      router names after a restart is dialed, and its bound ACK makes the old one dead (2).
      What may mark a peer P dead, and nothing else:
      (1) on a connection authenticated by the bound handshake with P (dialed: P's HELLO_ACK
      answered our HELLO; accepted: P's HELLO named us): EOF, a reset (keepalive turns a host
      that stopped answering into one), a failed send, a protocol error or a sealed record
      failing its tag;
      (2) a bound, authenticated greeting from another instance at P's address (a HELLO to
      us, or the HELLO_ACK to our HELLO): P restarted;
      (3) dialing P: the connect fails (nothing listens, or no answer in `dial_timeout_s`), the
      answer at P's address is not P's authenticated ACK to our HELLO or refuses our cipher,
      or P's address closes the connection before any HELLO_ACK on 1 + `handshake_redials`
      dials in a row;
      (4) this endpoint's own verdict (`peer_died`: NIXL could not fence a move to P).
      Nothing on an incoming connection that has not completed the bound handshake (refused,
      misaddressed, slow, malformed, over the cap) marks anyone dead or changes any state.
      A stalled peer is not dead: a connection its kernel accepted waits for its HELLO_ACK as
      long as the host answers keepalive, with the jobs queued behind it.
    - `close()` (idempotent; also on leaving a `with` block) fails every pending move, shuts
      down every socket (waking every thread) and joins the threads briefly; afterwards
      nothing is delivered, moves end in "error" and `peer_alive(local)` is False.

    Cancel. A move not yet started never starts. A write whose frame is being sent finishes
    that `sendmsg` first (cancel waits up to `cancel_wait_s`, then shuts the connection down).
    Frames already sent may still arrive after a control message the writer sends after
    `cancel` (the ABORT travels on the control connection); the receiver's `revoke` on that
    ABORT refuses them, and a frame landing meanwhile finishes before `revoke` returns. A read
    being landed stops at the next block of its READ_DATA frame; the rest of that frame and
    every later READ_DATA frame of a cancelled read are drained, never written to the pool.
    The holder may still be sending its source blocks for a cancelled read; those bytes are
    discarded by the requester.
    """

    def __init__(self, local_host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 instance_id: int | None = None, advertise_port: int | None = None,
                 advertise_host: str | None = None, options: TcpOptions | None = None) -> None:
        self.options = options or TcpOptions()
        listener = socket.create_server((local_host, port))
        self._local = PeerId(instance_id or process_instance_id(), advertise_host or local_host,
                             advertise_port or listener.getsockname()[1])
        throttled = ThrottledLog(log)
        self._peers = PeerTable(self._local)
        self._moves = MoveTable(self.options.cancel_wait_s)
        self._gate = PoolGate(throttled, self.options.cancel_wait_s)
        handshake = BoundHandshake(HandshakeAuth(secret), self._local, self.options,
                                   self._peers.seen, throttled)
        self._send = SendSide(self.options, handshake, self._gate, self._moves, self._peers)
        self._receive = ReceiveSide(listener, self.options, handshake, self._gate, self._moves,
                                    self._peers, self._send, throttled)
        self._peers.hold(self._moves, self._send, self._receive)
        self._receive.start()

    # -- Transport ---------------------------------------------------------------------------

    @property
    def local(self) -> PeerId:
        return self._local

    @property
    def closed(self) -> bool:
        return self._peers.closed

    def register(self, pool: KVCache) -> None:
        self._gate.register(pool)

    def write(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
              remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        return self._start("write", transfer_id, local_blocks, remote_peer, remote_blocks,
                           layers)

    def read(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
             remote_blocks: Sequence[int]) -> MoveHandle:
        return self._start("read", transfer_id, local_blocks, remote_peer, remote_blocks)

    def allow_writes(self, transfer_id: int, peer: PeerId, blocks: Sequence[int],
                     layers: range | None = None) -> None:
        self._gate.permits.allow("write", transfer_id, peer, blocks, layers)

    def allow_reads(self, transfer_id: int, peer: PeerId, blocks: Sequence[int]) -> None:
        self._gate.permits.allow("read", transfer_id, peer, blocks)

    def revoke(self, transfer_id: int) -> None:
        self._gate.revoke(transfer_id)

    def status(self, handle: MoveHandle) -> MoveStatus:
        return self._moves.status(handle)

    def cancel(self, handle: MoveHandle) -> None:
        self._moves.cancel(handle)

    def send(self, peer: PeerId, message: bytes) -> None:
        self._send.send(peer, message)

    def receive(self) -> list[tuple[PeerId, bytes]]:
        return self._receive.take_messages()

    def peer_alive(self, peer: PeerId) -> bool:
        return self._peers.alive(peer)

    def why_dead(self, peer: PeerId) -> str | None:
        return self._peers.why_dead(peer)

    def reach(self, peer: PeerId) -> None:
        if peer != self._local:
            self._send.reach(peer)

    def peers_lost(self) -> int:
        return self._peers.lost_now()

    def links(self) -> list[LinkReport]:
        return self._send.links()

    def peer_died(self, peer: PeerId, why: str) -> None:
        """Mark that instance dead for good and fail its pending moves (this endpoint's own
        verdict: NIXL could not fence a move to it, so it might still write with its keys)."""
        self._peers.died(peer, why)

    def close(self) -> None:
        if not self._peers.close():
            return
        self._moves.close()
        threads = [*self._receive.close(), *self._send.close()]
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=1.0)

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpTransport({self._local}, closed={self.closed})"

    def _start(self, kind: str, tid: int, local_blocks: Sequence[int], peer: PeerId,
               remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        pool = self._gate.pool
        if len(local_blocks) != len(remote_blocks) or not local_blocks:
            raise ValueError("a move needs one remote block per local block, at least one")
        if pool is None:
            raise ValueError("register a pool before moving blocks")
        if any(type(b) is not int or not 0 <= b < 1 << 32 for b in remote_blocks):
            raise ValueError("remote block ids must be integers in [0, 2**32)")
        try:
            pool.check(list(local_blocks), f"local blocks of a {kind}")
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        span = layer_span(layers, pool.num_layers)
        move = self._moves.add(kind, tid, peer, tuple(local_blocks), tuple(remote_blocks),
                               span)
        if not self._send.move(move):
            self._moves.fail(move)
        return move.handle
