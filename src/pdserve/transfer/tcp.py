"""`Transport` over plain TCP: whole KV blocks move between registered CPU pools, zero-copy.

The frame format and socket helpers are in `tcp_frames.py`, the bound handshake in
`tcp_handshake.py` (its messages in `tcp_hello.py`); this module holds the endpoint: its
threads, connections, permits, moves and their fences (life cycle on `TcpTransport`).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.auth import HandshakeAuth, PeerRefused
from pdserve.transfer.descriptors import PeerId, process_instance_id
from pdserve.transfer.permits import Kind, Permits
from pdserve.transfer.tcp_frames import (
    MAX_CONTROL_BYTES,
    MAX_SMALL_BYTES,
    BlockPool,
    Frame,
    ProtocolError,
    header,
    parse_u32s,
    shut,
    u32s,
)
from pdserve.transfer.tcp_handshake import BoundHandshake
from pdserve.transfer.tcp_hello import CIPHERS
from pdserve.transfer.tcp_peer import Job, Move, PeerSender
from pdserve.transfer.tcp_wire import Wire
from pdserve.transfer.transport import MoveHandle, MoveStatus, layer_span

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TcpOptions:
    """Timeouts and limits. `cancel_wait_s` bounds how long `cancel` waits for a frame that is
    being sent or received before it shuts that connection down; `max_queued` bounds each peer's
    send queue (a full queue drops control messages and fails new moves). `encrypt` seals
    every connection after its handshake with AES-256-GCM (`tcp_wire.py`); peers must agree,
    and a handshake between a sealed and a plain endpoint is refused on both sides.

    `dial_timeout_s` bounds the TCP connect (no answer: the peer is dead). `handshake_timeout_s`
    bounds the acceptor's whole handshake, from accept to the HELLO complete and answered (not
    each read: a client trickling bytes is cut off at the deadline too); a dialer whose peer's
    kernel accepted the connection but whose process has not answered HELLO_ACK by then logs a
    warning and keeps waiting (a stopped process is stalled, not dead). A dialed connection
    the acceptor closes before its HELLO_ACK (it refused the HELLO, or was full) is dialed again
    up to `handshake_redials` times, `handshake_timeout_s` / 2 apart, before the peer is given
    up. TCP keepalive on every connection (Linux's TCP_KEEPIDLE / TCP_KEEPINTVL / TCP_KEEPCNT)
    finds a host that stopped answering at all within about idle + interval x probes seconds
    (10 s by default); a stopped process's kernel still answers the probes.

    `max_connections` caps the connections an endpoint has accepted and not yet closed (one
    reader thread each); one more is closed at once, with a rate-limited warning. Each peer
    instance that talks to this endpoint holds one (its own dialed connection; this endpoint's
    connection to it is counted at the peer), and a connection that has not authenticated
    holds its slot for at most `handshake_timeout_s`: keep it above the number of workers."""

    dial_timeout_s: float = 1.0
    handshake_timeout_s: float = 2.0
    handshake_redials: int = 4
    cancel_wait_s: float = 5.0
    max_queued: int = 10_000
    max_connections: int = 64
    encrypt: bool = False
    keepalive_idle_s: int = 5
    keepalive_interval_s: int = 1
    keepalive_probes: int = 5

    @property
    def cipher(self) -> str:
        return CIPHERS[self.encrypt]

    def __post_init__(self) -> None:
        for name in ("dial_timeout_s", "handshake_timeout_s", "cancel_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TcpOptions.{name} must be > 0, got {getattr(self, name)}")
        for name in ("keepalive_idle_s", "keepalive_interval_s", "keepalive_probes",
                     "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TcpOptions.{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.handshake_redials, int) or self.handshake_redials < 0:
            raise ValueError("TcpOptions.handshake_redials must be a whole number >= 0, got "
                             f"{self.handshake_redials!r}")
        if self.max_queued < 1:
            raise ValueError(f"TcpOptions.max_queued must be >= 1, got {self.max_queued}")


# -- the transport -------------------------------------------------------------------------------


class TcpTransport:
    """One TCP endpoint of the transfer plane; implements `transport.Transport`.

    Life cycle.
    - Construction binds and listens on `local_host:port` (0: a free port) and starts one daemon
      accept thread. `local` is this instance: `instance_id` (default: the process's) at the
      advertised address (`advertise_port`, default: the real port; tests use it to simulate a
      restarted peer at the same address).
    - Incoming: at most `max_connections` accepted connections at a time (one more is closed at
      once), each with one daemon reader thread. It first expects, within `handshake_timeout_s`
      of the accept, a HELLO (`tcp_hello.py`) signed with the shared secret (`HandshakeAuth`)
      and addressed to exactly `local`; a bad signature, a replay, another kind of greeting, a
      HELLO addressed elsewhere (relayed), a malformed PeerId, an instance known dead or the
      deadline closes the connection with a rate-limited warning naming the remote address.
      A HELLO for another instance at this address (the dialer has not learnt of a restart)
      gets a signed HELLO_ACK first, so the dialer learns it, and is refused the same way. The
      reader answers a signed HELLO_ACK bound to that HELLO, then processes frames strictly in
      order: WRITE bytes land in the pool (recv_into the block's memory, no staging) before any
      later CONTROL frame on that connection is delivered. That order is the fence the sessions
      rely on (data before the writer's ABORT / ABORT_ACK).
    - Permits (`permits.py`): a WRITE lands only inside a write permit of its transfer id for
      the connection's authenticated peer (every block id, its layers); a READ_REQUEST is
      served only inside a read permit, checked again when its READ_DATA goes out. Anything
      else is drained without touching the pool and answered WRITE_ERROR / READ_ERROR "not
      permitted" (a rate-limited warning; a late move of the permit's own peer after `revoke`
      only a debug line). A refusal never ends the connection or marks anyone dead.
    - Outgoing: frames to a peer instance travel on one connection this endpoint dials lazily
      (first send / write / read), fed by that peer's `PeerSender` queue and thread, so `send`,
      `write` and `read` never block. Dialing waits at most `dial_timeout_s`.
    - Peer death marks that exact instance dead for good: `peer_alive` is False, its pending
      moves end in "error", messages to it are dropped; a new instance at the address is a
      different peer. What may mark a peer P dead, and nothing else:
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
      long as the host answers keepalive, with the jobs queued behind it. (Declaring it dead
      would break the pair for good once it wakes: each side would refuse the other.)
    - `close()` (idempotent; also on leaving a `with` block) fails every pending move, shuts
      down every socket (waking every thread) and joins the threads briefly; afterwards
      nothing is delivered, moves end in "error" and `peer_alive(local)` is False.

    Cancel. A move not yet started never starts. A write whose frame is being sent finishes
    that `sendmsg` first (cancel waits up to `cancel_wait_s`, then shuts the connection down):
    the bytes then lie in order on the one connection ahead of any control message the writer
    sends after `cancel`, so the receiver lands them before it sees, say, the ABORT. A read
    being landed stops at the next block boundary; READ_DATA for a cancelled read is drained,
    never written to the pool. The holder may still be reading its own source blocks for a
    cancelled read; those bytes are discarded by the requester.
    """

    def __init__(self, local_host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 instance_id: int | None = None, advertise_port: int | None = None,
                 options: TcpOptions | None = None) -> None:
        self.options = options or TcpOptions()
        self._auth = HandshakeAuth(secret)
        self._listener = socket.create_server((local_host, port))
        real_port = self._listener.getsockname()[1]
        self._local = PeerId(instance_id or process_instance_id(), local_host,
                             advertise_port or real_port)
        self._lock = threading.Condition()
        self._pool: BlockPool | None = None
        self._moves: dict[MoveHandle, Move] = {}
        self._handles = itertools.count(1)
        self._senders: dict[PeerId, PeerSender] = {}
        self._current: dict[tuple[str, int], int] = {}  # address -> newest instance seen
        self._dead: set[PeerId] = set()
        self._inbox: list[tuple[PeerId, bytes]] = []
        self._conns: dict[socket.socket, PeerId | None] = {}  # accepted -> authenticated peer
        self._permits = Permits()
        self._throttled = ThrottledLog(log)
        self._handshake = BoundHandshake(self._auth, self._local, self.options, self._seen,
                                         self._throttled)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept_loop, f"pdserve-tcp-accept-{real_port}")

    # -- Transport ---------------------------------------------------------------------------

    @property
    def local(self) -> PeerId:
        return self._local

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, pool: KVCache) -> None:
        self._pool = BlockPool(pool)

    def write(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
              remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        return self._start("write", transfer_id, local_blocks, remote_peer, remote_blocks,
                           layers)

    def read(self, transfer_id: int, local_blocks: Sequence[int], remote_peer: PeerId,
             remote_blocks: Sequence[int]) -> MoveHandle:
        return self._start("read", transfer_id, local_blocks, remote_peer, remote_blocks)

    def allow_writes(self, transfer_id: int, peer: PeerId, blocks: Sequence[int],
                     layers: range | None = None) -> None:
        self._permits.allow("write", transfer_id, peer, blocks, layers)

    def allow_reads(self, transfer_id: int, peer: PeerId, blocks: Sequence[int]) -> None:
        self._permits.allow("read", transfer_id, peer, blocks)

    def revoke(self, transfer_id: int) -> None:
        self._permits.revoke(transfer_id)

    def status(self, handle: MoveHandle) -> MoveStatus:
        with self._lock:
            return self._move(handle).status

    def cancel(self, handle: MoveHandle) -> None:
        with self._lock:
            move = self._move(handle)
            move.cancelled = True
            if move.status != "pending":
                return
            quiet = self._lock.wait_for(lambda: not move.busy, self.options.cancel_wait_s)
            force = None if quiet else move.sock
            self._finish(move, "error")
        if force is not None:
            log.warning("cancel of move %d timed out; dropping its connection", handle)
            shut(force)

    def send(self, peer: PeerId, message: bytes) -> None:
        sender = self._sender(peer)
        if sender is not None:
            sender.put(("control", bytes(message)))

    def receive(self) -> list[tuple[PeerId, bytes]]:
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def peer_alive(self, peer: PeerId) -> bool:
        with self._lock:
            return self._alive(peer)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for move in self._moves.values():
                move.cancelled = True
                self._finish(move, "error")
            senders, conns = list(self._senders.values()), list(self._conns)
            threads = [*self._threads, *(s.thread for s in senders)]
        shut(self._listener)
        for s in senders:
            s.stop()
        for c in conns:
            shut(c)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=1.0)

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpTransport({self._local}, closed={self._closed})"

    # -- moves (caller side) -----------------------------------------------------------------

    def _start(self, kind: str, tid: int, local_blocks: Sequence[int], peer: PeerId,
               remote_blocks: Sequence[int], layers: range | None = None) -> MoveHandle:
        if len(local_blocks) != len(remote_blocks) or not local_blocks:
            raise ValueError("a move needs one remote block per local block, at least one")
        if self._pool is None:
            raise ValueError("register a pool before moving blocks")
        if any(type(b) is not int or not 0 <= b < 1 << 32 for b in remote_blocks):
            raise ValueError("remote block ids must be integers in [0, 2**32)")
        try:
            self._pool.check(list(local_blocks), f"local blocks of a {kind}")
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        span = layer_span(layers, self._pool.num_layers)
        move = Move(next(self._handles), kind, tid, peer, tuple(local_blocks),
                    tuple(remote_blocks), span)
        with self._lock:
            self._moves[move.handle] = move
        sender = self._sender(peer)
        if sender is None or not sender.put(("move", move)):
            with self._lock:
                self._finish(move, "error")
        return move.handle

    def _move(self, handle: MoveHandle) -> Move:
        move = self._moves.get(handle)
        if move is None:
            raise ValueError(f"move handle {handle} was not issued by this endpoint")
        return move

    def _finish(self, move: Move, status: MoveStatus) -> None:
        """pending -> status, never back. Caller holds the lock."""
        if move.status == "pending":
            move.status = status
            self._lock.notify_all()

    def _sender(self, peer: PeerId) -> PeerSender | None:
        """The live sender to `peer`, made on first use; None if closed or the peer is dead."""
        with self._lock:
            if self._closed or not self._alive(peer):
                return None
            if peer not in self._senders:
                self._senders[peer] = PeerSender(self, peer)
            return self._senders[peer]

    def _alive(self, peer: PeerId) -> bool:
        if self._closed:
            return False
        if peer == self._local:
            return True
        current = self._current.get((peer.host, peer.port), peer.instance_id)
        return peer not in self._dead and current == peer.instance_id

    # -- peer bookkeeping --------------------------------------------------------------------

    def peer_died(self, peer: PeerId, why: str) -> None:
        """Mark that instance dead for good and fail its pending moves."""
        with self._lock:
            if peer in self._dead or self._closed:
                return
            self._dead.add(peer)
            for move in self._moves.values():
                if move.peer == peer:
                    move.cancelled = True
                    self._finish(move, "error")
            sender = self._senders.pop(peer, None)
            conns = [c for c, p in self._conns.items() if p == peer]
        log.warning("peer %s is dead: %s", peer, why)
        if sender is not None:
            sender.stop()
        for c in conns:
            shut(c)

    def _seen(self, peer: PeerId) -> None:
        """`peer` proved itself with a bound greeting (its HELLO to us, or its HELLO_ACK to our
        HELLO); an older instance at its address is dead. PeerRefused for one known dead."""
        with self._lock:
            if peer in self._dead:
                raise PeerRefused(f"instance {peer.instance_id:016x} is known dead")
            addr = (peer.host, peer.port)
            old = self._current.get(addr)
            self._current[addr] = peer.instance_id
        if old is not None and old != peer.instance_id:
            self.peer_died(PeerId(old, *addr), f"restarted as {peer.instance_id:016x}")

    def _keep_alive(self, sock: socket.socket) -> None:
        o = self.options
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, o.keepalive_idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, o.keepalive_interval_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, o.keepalive_probes)

    def connect(self, peer: PeerId) -> socket.socket:
        """A TCP connection to `peer`'s address within `dial_timeout_s`, with keepalive on."""
        sock = socket.create_connection((peer.host, peer.port), self.options.dial_timeout_s)
        try:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._keep_alive(sock)
        except OSError:
            shut(sock)
            raise
        return sock

    def handshake(self, sock: socket.socket, peer: PeerId) -> Wire:
        """The dialer's side of the bound handshake on `sock` (`BoundHandshake.dial`)."""
        return self._handshake.dial(sock, peer)

    # -- outgoing jobs (a PeerSender thread) -------------------------------------------------

    def run_job(self, wire: Wire, peer: PeerId, job: Job) -> None:
        kind = job[0]
        if kind == "control":
            wire.send([header(Frame.CONTROL, plen=len(job[1])), job[1]])
        elif kind == "move":
            self._send_move(wire, job[1])
        elif kind == "read_data":
            self._send_read_data(wire, peer, *job[1:])
        else:  # ("answer", frame, tid, mid, reason bytes)
            _, ftype, tid, mid, reason = job
            wire.send([header(ftype, 0, tid, mid, len(reason)), reason])

    def _claim(self, move: Move, sock: socket.socket) -> bool:
        """Mark a not-cancelled pending move busy on `sock`; False if it must not run."""
        with self._lock:
            if move.cancelled or move.status != "pending":
                return False
            move.busy, move.sock = True, sock
            return True

    def _release(self, move: Move) -> None:
        with self._lock:
            move.busy = False
            self._lock.notify_all()

    def _send_move(self, wire: Wire, move: Move) -> None:
        n, ids = len(move.remote_blocks), u32s(move.remote_blocks)
        if move.kind == "read":
            if self._claim(move, wire.sock):
                self._release(move)  # the request itself touches no pool
                wire.send([header(Frame.READ_REQUEST, n, move.transfer_id, move.handle,
                                  len(ids)), ids])
            return
        pool = self._pool
        assert pool is not None
        if not self._claim(move, wire.sock):
            return
        first, end = move.layers or (0, pool.num_layers)
        prefix = u32s([first, end]) + ids
        try:
            head = header(Frame.WRITE, n, move.transfer_id, move.handle,
                          len(prefix) + n * (end - first) * pool.layer_nbytes)
            wire.send([head, prefix, *(pool.view(b, (first, end)) for b in move.local_blocks)])
        finally:
            self._release(move)

    def _send_read_data(self, wire: Wire, peer: PeerId, tid: int, mid: int,
                        ids: tuple[int, ...]) -> None:
        pool = self._pool
        refusal = None if pool is None else self._refusal("read", peer, tid, ids, None)
        if pool is None or refusal is not None:  # the permit may have ended since the request
            reason = (refusal or "no pool registered").encode()
            wire.send([header(Frame.READ_ERROR, 0, tid, mid, len(reason)), reason])
            return
        head = header(Frame.READ_DATA, len(ids), tid, mid, len(ids) * pool.block_nbytes)
        wire.send([head, *(pool.view(b) for b in ids)])

    def _answer(self, peer: PeerId, ftype: Frame, tid: int, mid: int, reason: bytes = b"") -> None:
        sender = self._sender(peer)
        if sender is not None:
            sender.put(("answer", ftype, tid, mid, reason))

    # -- incoming (accept thread and one reader thread per connection) -----------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=name)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            deadline = time.monotonic() + self.options.handshake_timeout_s
            with self._lock:
                if self._closed:
                    shut(conn)
                    return
                full = len(self._conns) >= self.options.max_connections
                if not full:
                    self._conns[conn] = None
                    self._threads = [t for t in self._threads if t.is_alive()]
            if full:
                shut(conn)
                self._throttled.warn(
                    "full", "refused connection from %s:%s: %d connections are open, this "
                    "endpoint's limit (TcpOptions.max_connections)", addr[0], addr[1],
                    self.options.max_connections)
                continue
            self._spawn(self._serve, f"pdserve-tcp-read-{addr[0]}:{addr[1]}", conn, addr,
                        deadline)

    def _serve(self, conn: socket.socket, addr: tuple[str, int], deadline: float) -> None:
        peer = None
        try:
            self._keep_alive(conn)
            greeted = self._handshake.accept(conn, addr, deadline)
            if greeted is not None:
                peer, wire = greeted
                with self._lock:
                    self._conns[conn] = peer
                while True:
                    self._dispatch(wire, peer, *wire.recv_header())
        except (OSError, EOFError, ValueError) as e:
            if peer is not None and not self._closed:
                self.peer_died(peer, f"incoming connection ended: {e}")
        finally:
            shut(conn)
            with self._lock:
                self._conns.pop(conn, None)

    def _dispatch(self, wire: Wire, peer: PeerId, ftype: Frame, count: int, tid: int,
                  mid: int, plen: int) -> None:
        if ftype is Frame.CONTROL:
            self._on_control(wire, peer, plen)
        elif ftype is Frame.WRITE:
            self._on_write(wire, peer, count, tid, mid, plen)
        elif ftype is Frame.READ_REQUEST:
            self._on_read_request(wire, peer, count, tid, mid, plen)
        elif ftype is Frame.READ_DATA:
            self._on_read_data(wire, peer, count, mid, plen)
        elif ftype in (Frame.WRITE_DONE, Frame.WRITE_ERROR, Frame.READ_ERROR):
            self._on_answer(wire, peer, ftype, mid, plen)
        else:
            raise ProtocolError(f"unexpected {ftype.name} after the handshake")

    def _on_control(self, wire: Wire, peer: PeerId, plen: int) -> None:
        if plen > MAX_CONTROL_BYTES:
            raise ProtocolError(f"control message of {plen} bytes exceeds {MAX_CONTROL_BYTES}")
        data = wire.recv_exact(plen)
        with self._lock:
            if self._alive(peer):
                self._inbox.append((peer, data))

    def _block_frame(self, count: int, plen: int, id_bytes: int) -> BlockPool:
        """The registered pool, if `plen` is exactly `id_bytes` + count whole blocks."""
        pool = self._pool
        if pool is None:
            raise ProtocolError("blocks sent to an endpoint without a registered pool")
        if not 1 <= count <= pool.num_blocks or plen != id_bytes + count * pool.block_nbytes:
            raise ProtocolError(f"{count} blocks in a payload of {plen} bytes")
        return pool

    def _on_write(self, wire: Wire, peer: PeerId, count: int, tid: int, mid: int,
                  plen: int) -> None:
        prefix = 8 + 4 * count
        if self._pool is None:  # nothing to land into: refuse the move, keep the connection
            if count < 1 or plen < prefix or (plen - prefix) % count:
                raise ProtocolError(f"WRITE of {count} blocks in a payload of {plen} bytes")
            wire.skip([prefix] + [(plen - prefix) // count] * count)
            self._answer(peer, Frame.WRITE_ERROR, tid, mid, b"no pool registered")
            return
        pool = self._pool
        if not 1 <= count <= pool.num_blocks or plen < prefix:
            raise ProtocolError(f"WRITE of {count} blocks in a payload of {plen} bytes")
        first, end, *ids = parse_u32s(wire.recv_exact(prefix))
        pool.check_layers(first, end)
        if plen != prefix + count * (end - first) * pool.layer_nbytes:
            raise ProtocolError(f"WRITE of {count} blocks x layers [{first}, {end}) in a "
                                f"payload of {plen} bytes")
        pool.check(ids, "WRITE destination")
        refusal = self._refusal("write", peer, tid, ids, (first, end))
        if refusal is not None:  # drained, the pool untouched; the connection lives on
            wire.skip([(end - first) * pool.layer_nbytes] * count)
            self._answer(peer, Frame.WRITE_ERROR, tid, mid, refusal.encode())
            return
        for b in ids:
            wire.recv_into(pool.view(b, (first, end)))
        self._answer(peer, Frame.WRITE_DONE, tid, mid)

    def _on_read_request(self, wire: Wire, peer: PeerId, count: int, tid: int,
                         mid: int, plen: int) -> None:
        if self._pool is None:
            wire.skip([plen])
            self._answer(peer, Frame.READ_ERROR, tid, mid, b"no pool registered")
            return
        self._block_frame(count, plen + count * self._pool.block_nbytes, 4 * count)
        ids = parse_u32s(wire.recv_exact(plen))
        self._pool.check(ids, "READ_REQUEST source")
        refusal = self._refusal("read", peer, tid, ids, None)
        if refusal is not None:
            self._answer(peer, Frame.READ_ERROR, tid, mid, refusal.encode())
            return
        sender = self._sender(peer)
        if sender is not None:
            sender.put(("read_data", tid, mid, ids))

    def _refusal(self, kind: Kind, peer: PeerId, tid: int, ids: Sequence[int],
                 layers: tuple[int, int] | None) -> str | None:
        """None when `peer` holds a permit for this move; else the reason, logged: a warning
        (rate-limited) for a stray, a debug line for a late move of the permit's own peer."""
        pool = self._pool
        assert pool is not None
        refusal = self._permits.refusal(kind, tid, peer, ids, layers or (0, pool.num_layers))
        if refusal is None:
            return None
        if refusal.late:
            log.debug("dropped a late %s from %s: %s", kind, peer, refusal.reason)
        else:
            self._throttled.warn(kind, "refused a %s from %s: %s", kind, peer, refusal.reason)
        return refusal.reason

    def _on_read_data(self, wire: Wire, peer: PeerId, count: int, mid: int,
                      plen: int) -> None:
        pool = self._block_frame(count, plen, 0)
        move = self._own_move(peer, mid, "read")
        if len(move.local_blocks) != count:
            raise ProtocolError(f"READ_DATA of {count} blocks for a read of "
                                f"{len(move.local_blocks)}")
        for i, b in enumerate(move.local_blocks):
            if not self._claim(move, wire.sock):
                wire.skip([pool.block_nbytes] * (count - i))
                return
            try:
                wire.recv_into(pool.view(b))
            finally:
                self._release(move)
        with self._lock:
            if not move.cancelled:
                self._finish(move, "done")

    def _on_answer(self, wire: Wire, peer: PeerId, ftype: Frame, mid: int,
                   plen: int) -> None:
        if plen > MAX_SMALL_BYTES:
            raise ProtocolError(f"{ftype.name} of {plen} bytes")
        reason = wire.recv_exact(plen).decode("utf-8", "replace")
        move = self._own_move(peer, mid, "read" if ftype is Frame.READ_ERROR else "write")
        with self._lock:
            cancelled = move.cancelled  # its transfer ended here: a refusal is expected
            if not cancelled:
                self._finish(move, "done" if ftype is Frame.WRITE_DONE else "error")
        if ftype is not Frame.WRITE_DONE:
            (log.debug if cancelled else log.warning)("%s move %d failed at %s: %s", move.kind,
                                                      mid, peer, reason)

    def _own_move(self, peer: PeerId, mid: int, kind: str) -> Move:
        with self._lock:
            move = self._moves.get(mid)
        if move is None or move.peer != peer or move.kind != kind:
            raise ProtocolError(f"answer for move {mid}, which is not a {kind} to {peer}")
        return move
