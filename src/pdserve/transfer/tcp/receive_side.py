"""The TCP endpoint's receive side: the accept loop and one reader thread per connection.

A reader first runs the acceptor's handshake, then handles the peer's frames strictly in
order. A peer dials two connections (control and bulk, `send_side.py`), so its control
messages may arrive before bulk frames it sent earlier: the fence the sessions rely on is the
permit's (`PoolGate.use` / `revoke`), not the order of arrival. A WRITE lands inside a use of
its write permit, so once the session revokes (on the writer's ABORT, say) no byte of it lands.
WRITEs and READ_REQUESTs are checked against the permits here, and answered through the send
side. The READ_DATA frames of
one of this endpoint's reads come in order, each continuing at the (block, layer) slice where
the last one ended (anything else is a protocol error); the read is done once every slice has
landed. They, and the answers to this endpoint's own moves, settle its moves in the move
table. Each WRITE and READ_DATA frame read is reported to the endpoint's `IncomingShare`
(with the link window on, `TcpOptions.frame_s` > 0), which gives the peers sending bulk data
at once equal windows (`incoming_share.py`).

Collaborators, given at construction: the listening socket, the options, the handshake
(accepting), the pool gate (where blocks land, the permits), the move table, the peer table
(who is alive; where a broken authenticated connection is reported), the send side (the
answers and READ_DATA owed to a peer go out on this endpoint's own connection to it) and the
rate-limited log.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp.frames import (
    MAX_CONTROL_BYTES,
    MAX_SMALL_BYTES,
    Frame,
    ProtocolError,
    parse_u32s,
    shut,
)
from pdserve.transfer.tcp.handshake import BoundHandshake
from pdserve.transfer.tcp.incoming_share import IncomingShare
from pdserve.transfer.tcp.moves import MoveTable
from pdserve.transfer.tcp.options import TcpOptions
from pdserve.transfer.tcp.peers import PeerTable
from pdserve.transfer.tcp.pool import BlockPool, PoolGate
from pdserve.transfer.tcp.send_side import SendSide
from pdserve.transfer.tcp.wire import Wire

log = logging.getLogger(__name__)


class ReceiveSide:
    """Accepts connections on `listener` (at most `max_connections` open; one more is closed
    at once), reads each on its own daemon thread and keeps the control messages delivered
    until `take_messages`. Thread-safe. Lifetime: from `start` until `close`, which shuts the
    listener and every accepted connection."""

    def __init__(self, listener: socket.socket, options: TcpOptions, handshake: BoundHandshake,
                 gate: PoolGate, moves: MoveTable, peers: PeerTable, send: SendSide,
                 throttled: ThrottledLog) -> None:
        self._listener, self._options, self._handshake = listener, options, handshake
        self._gate, self._moves, self._peers, self._send = gate, moves, peers, send
        self._throttled = throttled
        self._share = IncomingShare(options.frame_s) if options.frame_s > 0 else None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, PeerId | None] = {}  # accepted -> authenticated peer
        self._inbox: list[tuple[PeerId, bytes]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False

    def start(self) -> None:
        self._spawn(self._accept_loop, f"pdserve-tcp-accept-{self._listener.getsockname()[1]}")

    def take_messages(self) -> list[tuple[PeerId, bytes]]:
        """The control messages delivered since the last call, with their authenticated source."""
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def drop_peer(self, peer: PeerId) -> None:
        with self._lock:
            conns = [c for c, p in self._conns.items() if p == peer]
        for c in conns:
            shut(c)

    def close(self) -> list[threading.Thread]:
        """Shut the listener and every connection; the threads, for the caller to join."""
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        shut(self._listener)
        for c in conns:
            shut(c)
        return threads

    # -- connections ---------------------------------------------------------------------------

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
            deadline = time.monotonic() + self._options.handshake_timeout_s
            with self._lock:
                if self._closed:
                    shut(conn)
                    return
                full = len(self._conns) >= self._options.max_connections
                if not full:
                    self._conns[conn] = None
                    self._threads = [t for t in self._threads if t.is_alive()]
            if full:
                shut(conn)
                self._throttled.warn(
                    "full", "refused connection from %s:%s: %d connections are open, this "
                    "endpoint's limit (TcpOptions.max_connections)", addr[0], addr[1],
                    self._options.max_connections)
                continue
            self._spawn(self._serve, f"pdserve-tcp-read-{addr[0]}:{addr[1]}", conn, addr,
                        deadline)

    def _serve(self, conn: socket.socket, addr: tuple[str, int], deadline: float) -> None:
        peer = None
        try:
            self._options.keep_alive(conn)
            greeted = self._handshake.accept(conn, addr, deadline)
            if greeted is not None:
                peer, wire = greeted
                with self._lock:
                    self._conns[conn] = peer
                if self._share is not None:
                    self._share.joined(conn)
                while True:
                    self._dispatch(wire, peer, *wire.recv_header())
        except (OSError, EOFError, ValueError) as e:
            if peer is not None and not self._closed:  # a protocol error is no lost link
                self._peers.died(peer, f"incoming connection ended: {e}",
                                 lost=not isinstance(e, ValueError))
        finally:
            if self._share is not None:
                self._share.forget(conn)
            shut(conn)
            with self._lock:
                self._conns.pop(conn, None)

    # -- frames --------------------------------------------------------------------------------

    def _dispatch(self, wire: Wire, peer: PeerId, ftype: Frame, count: int, tid: int,
                  mid: int, plen: int) -> None:
        if ftype is Frame.CONTROL:
            self._on_control(wire, peer, plen)
        elif ftype is Frame.WRITE:
            self._on_write(wire, peer, count, tid, mid, plen)
            self._bulk_arrived(wire)
        elif ftype is Frame.READ_REQUEST:
            self._on_read_request(wire, peer, count, tid, mid, plen)
        elif ftype is Frame.READ_DATA:
            self._on_read_data(wire, peer, count, mid, plen)
            self._bulk_arrived(wire)
        elif ftype in (Frame.WRITE_DONE, Frame.WRITE_ERROR, Frame.READ_ERROR):
            self._on_answer(wire, peer, ftype, mid, plen)
        else:
            raise ProtocolError(f"unexpected {ftype.name} after the handshake")

    def _bulk_arrived(self, wire: Wire) -> None:
        if self._share is not None:
            self._share.arrived(wire.sock)

    def _on_control(self, wire: Wire, peer: PeerId, plen: int) -> None:
        if plen > MAX_CONTROL_BYTES:
            raise ProtocolError(f"control message of {plen} bytes exceeds {MAX_CONTROL_BYTES}")
        data = wire.recv_exact(plen)
        if self._peers.alive(peer):
            with self._lock:
                self._inbox.append((peer, data))

    def _block_frame(self, count: int, plen: int, id_bytes: int) -> BlockPool:
        """The registered pool, if `plen` is exactly `id_bytes` + count whole blocks."""
        pool = self._gate.pool
        if pool is None:
            raise ProtocolError("blocks sent to an endpoint without a registered pool")
        if not 1 <= count <= pool.num_blocks or plen != id_bytes + count * pool.block_nbytes:
            raise ProtocolError(f"{count} blocks in a payload of {plen} bytes")
        return pool

    def _on_write(self, wire: Wire, peer: PeerId, count: int, tid: int, mid: int,
                  plen: int) -> None:
        prefix = 8 + 4 * count
        pool = self._gate.pool
        if pool is None:  # nothing to land into: refuse the move, keep the connection
            if count < 1 or plen < prefix or (plen - prefix) % count:
                raise ProtocolError(f"WRITE of {count} blocks in a payload of {plen} bytes")
            wire.skip([prefix] + [(plen - prefix) // count] * count)
            self._send.answer(peer, Frame.WRITE_ERROR, tid, mid, b"no pool registered")
            return
        if not 1 <= count <= pool.num_blocks or plen < prefix:
            raise ProtocolError(f"WRITE of {count} blocks in a payload of {plen} bytes")
        first, end, *ids = parse_u32s(wire.recv_exact(prefix))
        pool.check_layers(first, end)
        if plen != prefix + count * (end - first) * pool.layer_nbytes:
            raise ProtocolError(f"WRITE of {count} blocks x layers [{first}, {end}) in a "
                                f"payload of {plen} bytes")
        pool.check(ids, "WRITE destination")
        with self._gate.use("write", peer, tid, ids, (first, end), wire.sock) as refusal:
            if refusal is None:
                for b in ids:
                    wire.recv_into(pool.view(b, (first, end)))
        if refusal is not None:  # drained, the pool untouched; the connection lives on
            wire.skip([(end - first) * pool.layer_nbytes] * count)
            self._send.answer(peer, Frame.WRITE_ERROR, tid, mid, refusal.encode())
            return
        self._send.answer(peer, Frame.WRITE_DONE, tid, mid)

    def _on_read_request(self, wire: Wire, peer: PeerId, count: int, tid: int,
                         mid: int, plen: int) -> None:
        pool = self._gate.pool
        if pool is None:
            wire.skip([plen])
            self._send.answer(peer, Frame.READ_ERROR, tid, mid, b"no pool registered")
            return
        self._block_frame(count, plen + count * pool.block_nbytes, 4 * count)
        ids = parse_u32s(wire.recv_exact(plen))
        pool.check(ids, "READ_REQUEST source")
        refusal = self._gate.refusal("read", peer, tid, ids, None)
        if refusal is not None:
            self._send.answer(peer, Frame.READ_ERROR, tid, mid, refusal.encode())
            return
        self._send.read_data(peer, tid, mid, ids)

    def _on_read_data(self, wire: Wire, peer: PeerId, count: int, mid: int,
                      plen: int) -> None:
        """One READ_DATA frame of a read: it must continue the read where the last one ended;
        its slices land in the read's blocks (drained once the read is cancelled)."""
        pool = self._gate.pool
        if pool is None:
            raise ProtocolError("blocks sent to an endpoint without a registered pool")
        move = self._moves.owned(peer, mid, "read")
        prefix = 8 + 4 * count
        if not 1 <= count <= len(move.local_blocks) or plen < prefix:
            raise ProtocolError(f"READ_DATA of {count} blocks in a payload of {plen} bytes")
        first, end, *ids = parse_u32s(wire.recv_exact(prefix))
        pool.check_layers(first, end)
        span = (end - first) * pool.layer_nbytes
        if plen != prefix + count * span:
            raise ProtocolError(f"READ_DATA of {count} blocks x layers [{first}, {end}) in a "
                                f"payload of {plen} bytes")
        at = self._continues(move.remote_blocks, self._moves.slices_arrived(move),
                             pool.num_layers, tuple(ids), first, end)
        for i, b in enumerate(move.local_blocks[at : at + count]):
            if not self._moves.claim(move, wire.sock):
                wire.skip([span] * (count - i))
                break
            try:
                wire.recv_into(pool.view(b, (first, end)))
            finally:
                self._moves.release(move)
        self._moves.arrived(move, count * (end - first),
                            len(move.local_blocks) * pool.num_layers)

    @staticmethod
    def _continues(remote: tuple[int, ...], arrived: int, num_layers: int,
                   ids: tuple[int, ...], first: int, end: int) -> int:
        """The index in the read of the frame's first block, if the frame's slices (`ids` x
        layers [first, end)) are the next ones after the `arrived` slices in block-major order
        (whole blocks when it names several); else ProtocolError."""
        at, layer = divmod(arrived, num_layers)
        whole = (first, end) == (0, num_layers)
        if ids != remote[at : at + len(ids)] or first != layer or (len(ids) > 1 and not whole):
            raise ProtocolError(f"READ_DATA of blocks {list(ids)[:8]} x layers [{first}, {end}) "
                                f"does not continue its read at slice {arrived} of "
                                f"{len(remote) * num_layers}")
        return at

    def _on_answer(self, wire: Wire, peer: PeerId, ftype: Frame, mid: int,
                   plen: int) -> None:
        if plen > MAX_SMALL_BYTES:
            raise ProtocolError(f"{ftype.name} of {plen} bytes")
        reason = wire.recv_exact(plen).decode("utf-8", "replace")
        move = self._moves.owned(peer, mid, "read" if ftype is Frame.READ_ERROR else "write")
        # a cancelled move's transfer ended here: a refusal is expected
        settled = (self._moves.frame_done(move) if ftype is Frame.WRITE_DONE
                   else self._moves.settle(move, "error"))
        if ftype is not Frame.WRITE_DONE:
            (log.debug if not settled else log.warning)("%s move %d failed at %s: %s",
                                                        move.kind, mid, peer, reason)
