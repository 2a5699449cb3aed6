"""The TCP endpoint's send side: two outgoing connections per peer instance, each fed by a queue.

Everything this endpoint sends to a peer is a job on one of that peer's two lanes, each a
`SendQueue` sent by its own `PeerSender` thread on a connection of its own, so `send`, `write`
and `read` never block:
- the control lane carries control messages, the answers this endpoint owes the peer's
  moves (WRITE_DONE / WRITE_ERROR, a refused READ_REQUEST) and this endpoint's read requests,
  each a few hundred bytes, in the order they were queued;
- the bulk lane carries writes (WRITE frames) and the answers to the peer's reads (READ_DATA
  frames, or the READ_ERROR that ends one).
A control message so never waits behind bulk data: not in a queue, not in a socket's buffer,
not in the bulk connection's congestion window (which BBR holds at 4 segments for 200 ms every
10 s while a queue persists). What it shares is the network's own queue, which the receiver's
window bounds (`incoming_share.py`). With `TcpOptions.control_connection` off, one connection
per peer carries both, urgent jobs still ahead of queued bulk ones.

On the bulk lane a write and the answer to a read go out in frames of about
`TcpOptions.frame_s` of the link (`chunks.py`, `frame_pace.py`), and the socket holds at most
one frame not yet sent (TCP_NOTSENT_LOWAT). Each READ_DATA frame goes out only inside the read
permit (`PoolGate.use`); once the permit no longer covers its blocks, the rest of that read is
one READ_ERROR and no further frame of it goes out. A write is fenced (`MoveTable.cancel`)
before its sender queues an ABORT, so no frame of it starts after the ABORT is queued; frames
already sent may arrive after the ABORT (it travels on the other connection), and the receiver
refuses them: its `revoke` fences the permit (`PoolGate.revoke`), see `TcpTransport`.

Collaborators, given at construction: the options, the handshake (dialing), the pool gate
(block views, the read permits used as each READ_DATA frame goes out), the move table (a
write is claimed while each frame's bytes go out), and the peer table (who is alive; where a
failed connection is reported: either lane's failure is the peer's).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Literal

from pdserve.transfer.link_report import LinkReport
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import chunks
from pdserve.transfer.tcp.frame_pace import FramePace
from pdserve.transfer.tcp.frames import Frame, HandshakeCut, PeerReplaced, header, shut, u32s
from pdserve.transfer.tcp.handshake import BoundHandshake
from pdserve.transfer.tcp.moves import Move, MoveTable
from pdserve.transfer.tcp.options import TcpOptions
from pdserve.transfer.tcp.peers import PeerTable
from pdserve.transfer.tcp.pool import PoolGate
from pdserve.transfer.tcp.send_queue import Job, SendQueue
from pdserve.transfer.tcp.tcp_info import tcp_info
from pdserve.transfer.tcp.wire import Wire

log = logging.getLogger(__name__)

# Jobs: ("control", bytes) | ("move", Move) | ("write", Move, [Chunk], next index)
#       | ("read_data", tid, mid, ids) | ("read_frame", tid, mid, ids, [Chunk], next index)
#       | ("answer", frame, tid, mid, reason)
URGENT = frozenset({"control", "answer"})
Lane = Literal["control", "bulk"]


class SendSide:
    """The live `PeerSender`s of every peer instance this endpoint talks to, made on first use
    (both lanes by `reach`). Thread-safe. Lifetime: the endpoint's; `close` stops every
    sender."""

    def __init__(self, options: TcpOptions, handshake: BoundHandshake, gate: PoolGate,
                 moves: MoveTable, peers: PeerTable) -> None:
        self._options, self._handshake, self._peers = options, handshake, peers
        self._writer = JobWriter(gate, moves)
        self._lock = threading.Lock()
        self._senders: dict[tuple[PeerId, Lane], PeerSender] = {}

    def send(self, peer: PeerId, message: bytes) -> None:
        """Queue a control message; dropped if the peer is dead or its queue is full."""
        self._put(peer, ("control", bytes(message)))

    def move(self, move: Move) -> bool:
        """Queue a write or a read request; False if it cannot be (dead peer, full queue)."""
        return self._put(move.peer, ("move", move))

    def answer(self, peer: PeerId, ftype: Frame, tid: int, mid: int, reason: bytes = b"") -> None:
        """Queue the answer to a peer's WRITE or READ_REQUEST."""
        self._put(peer, ("answer", ftype, tid, mid, reason))

    def read_data(self, peer: PeerId, tid: int, mid: int, ids: tuple[int, ...]) -> None:
        """Queue the READ_DATA frames of blocks `ids` a permitted READ_REQUEST asked for."""
        self._put(peer, ("read_data", tid, mid, ids))

    def reach(self, peer: PeerId) -> None:
        """Make the senders to `peer` now, if it is alive and has none: their threads dial at
        once, so a dead or replaced instance is known before anything must go to it, and the
        first transfer finds its connections made."""
        for lane in self._lanes():
            self._sender(peer, lane)

    def links(self) -> list[LinkReport]:
        """The kernel's estimates for each live bulk connection this endpoint dialed; the rate
        is the current sample's unless the sender limited it (`app_limited`) and a sample of a
        full sender was read during a transfer (`full_rate`)."""
        with self._lock:
            senders = [s for (_, lane), s in self._senders.items()
                       if lane == "bulk" and not s.stopped]
        reports = []
        for s in senders:
            info = None if s.sock is None else tcp_info(s.sock)
            if info is not None:
                rate, limited = info.delivery_rate, info.app_limited
                if limited and s.full_rate:  # the last rate of a full sender instead
                    rate, limited = s.full_rate, False
                reports.append(LinkReport(
                    f"{s.peer.host}:{s.peer.port}", "tcp_info", rate * 8 / 1e9 if rate else None,
                    info.bytes_acked, info.rtt_us / 1e3, info.min_rtt_us / 1e3, limited))
        return reports

    def drop_peer(self, peer: PeerId) -> None:
        with self._lock:
            senders = [self._senders.pop(key) for key in list(self._senders) if key[0] == peer]
        for sender in senders:
            sender.stop()

    def close(self) -> list[threading.Thread]:
        """Stop every sender; their threads, for the caller to join."""
        with self._lock:
            senders = list(self._senders.values())
        for s in senders:
            s.stop()
        return [s.thread for s in senders]

    def _lanes(self) -> tuple[Lane, ...]:
        return ("control", "bulk") if self._options.control_connection else ("bulk",)

    def _put(self, peer: PeerId, job: Job) -> bool:
        urgent = job[0] in URGENT or (job[0] == "move" and job[1].kind == "read")
        lane: Lane = "control" if urgent and self._options.control_connection else "bulk"
        sender = self._sender(peer, lane)
        return sender is not None and sender.jobs.put(job, urgent)

    def _sender(self, peer: PeerId, lane: Lane) -> PeerSender | None:
        """The live sender of `lane` to `peer`, made on first use; None if closed or the peer
        is dead."""
        with self._lock:
            if not self._peers.alive(peer):
                return None
            if (peer, lane) not in self._senders:
                self._senders[peer, lane] = PeerSender(peer, lane, self._options,
                                                       self._handshake, self._writer,
                                                       self._peers)
            return self._senders[peer, lane]


class JobWriter:
    """Turns one queued job into frames on a wire. Called by sender threads only."""

    def __init__(self, gate: PoolGate, moves: MoveTable) -> None:
        self._gate, self._moves = gate, moves

    def run(self, wire: Wire, peer: PeerId, job: Job, pace: FramePace | None) -> Job | None:
        """Send `job`, or a write's or read's next frame (sized by `pace`; None: one frame a
        move); the rest of the write or read, if any, to resume."""
        kind = job[0]
        if kind == "control":
            wire.send([header(Frame.CONTROL, plen=len(job[1])), job[1]])
        elif kind == "move":
            return self._send_move(wire, job[1], pace)
        elif kind == "write":
            return self._send_frame(wire, *job[1:], pace)
        elif kind == "read_data":
            return self._send_read_data(wire, peer, *job[1:], pace)
        elif kind == "read_frame":
            return self._send_read_frame(wire, peer, *job[1:], pace)
        else:  # ("answer", frame, tid, mid, reason bytes)
            _, ftype, tid, mid, reason = job
            wire.send([header(ftype, 0, tid, mid, len(reason)), reason])
        return None

    def _send_move(self, wire: Wire, move: Move, pace: FramePace | None) -> Job | None:
        n, ids = len(move.remote_blocks), u32s(move.remote_blocks)
        if move.kind == "read":
            if self._moves.claim(move, wire.sock):
                self._moves.release(move)  # the request itself touches no pool
                wire.send([header(Frame.READ_REQUEST, n, move.transfer_id, move.handle,
                                  len(ids)), ids])
            return None
        pool = self._gate.pool
        assert pool is not None
        first, end = move.layers or (0, pool.num_layers)
        budget = 0 if pace is None else pace.bytes
        frames = chunks.plan(n, first, end, pool.layer_nbytes, budget)
        self._moves.expect_frames(move, len(frames))
        return self._send_frame(wire, move, frames, 0, pace)

    def _send_frame(self, wire: Wire, move: Move, frames: list[chunks.Chunk], i: int,
                    pace: FramePace | None) -> Job | None:
        """Frame i of a write (unless it was fenced); the job of the frames after it."""
        if not self._moves.claim(move, wire.sock):
            return None
        c = frames[i]
        try:
            self._send_slices(wire, Frame.WRITE, move.transfer_id, move.handle, c,
                              move.remote_blocks[c.blocks], move.local_blocks[c.blocks], pace)
        finally:
            self._moves.release(move)
        return ("write", move, frames, i + 1) if i + 1 < len(frames) else None

    def _send_read_data(self, wire: Wire, peer: PeerId, tid: int, mid: int,
                        ids: tuple[int, ...], pace: FramePace | None) -> Job | None:
        """The first READ_DATA frame of a read (or its READ_ERROR); the job of the rest."""
        pool = self._gate.pool
        if pool is None:
            self._refuse_read(wire, tid, mid, "no pool registered")
            return None
        budget = 0 if pace is None else pace.bytes
        frames = chunks.plan(len(ids), 0, pool.num_layers, pool.layer_nbytes, budget)
        return self._send_read_frame(wire, peer, tid, mid, ids, frames, 0, pace)

    def _send_read_frame(self, wire: Wire, peer: PeerId, tid: int, mid: int,
                         ids: tuple[int, ...], frames: list[chunks.Chunk], i: int,
                         pace: FramePace | None) -> Job | None:
        """Frame i of a read's answer while the permit still covers its slices (it may have
        ended since the request or the last frame), else READ_ERROR and nothing more; the
        job of the frames after it."""
        c = frames[i]
        blocks = ids[c.blocks]
        if self._gate.pool is None:
            self._refuse_read(wire, tid, mid, "no pool registered")
            return None
        with self._gate.use("read", peer, tid, blocks, (c.first, c.end), wire.sock) as refusal:
            if refusal is None:
                self._send_slices(wire, Frame.READ_DATA, tid, mid, c, blocks, blocks, pace)
        if refusal is not None:
            self._refuse_read(wire, tid, mid, refusal)
            return None
        return ("read_frame", tid, mid, ids, frames, i + 1) if i + 1 < len(frames) else None

    def _send_slices(self, wire: Wire, ftype: Frame, tid: int, mid: int, c: chunks.Chunk,
                     named: tuple[int, ...], local: tuple[int, ...],
                     pace: FramePace | None) -> None:
        """One WRITE or READ_DATA frame: layers [c.first, c.end) of blocks `local` of this
        pool, named `named` in its prefix; then `pace` reads the link again."""
        pool = self._gate.pool
        assert pool is not None
        prefix = u32s([c.first, c.end]) + u32s(named)
        nbytes = len(local) * (c.end - c.first) * pool.layer_nbytes
        head = header(ftype, len(named), tid, mid, len(prefix) + nbytes)
        wire.send([head, prefix, *(pool.view(b, (c.first, c.end)) for b in local)])
        if pace is not None:
            pace.observe(wire.sock)

    @staticmethod
    def _refuse_read(wire: Wire, tid: int, mid: int, why: str) -> None:
        reason = why.encode()
        wire.send([header(Frame.READ_ERROR, 0, tid, mid, len(reason)), reason])


class PeerSender:
    """One lane's outgoing connection to one peer instance and its daemon sender thread.

    The thread dials as soon as it starts (the sender is made on the first job or `reach`:
    HELLO, then it waits for the signed HELLO_ACK however long a stalled peer takes, see
    `TcpOptions`), then sends its jobs in the `SendQueue`'s order on that one connection. Another
    instance answering at the peer's address means the peer restarted: it is dead for good.
    A connection the peer's address closes before any HELLO_ACK (it refused us, or was at its
    connection limit: nothing authenticated) is dialed again, up to `handshake_redials` times,
    with the jobs kept queued. A second daemon thread watches the
    connection: the acceptor never sends after HELLO_ACK, so EOF or reset means the peer is gone.
    Any other failure, or the last cut handshake, declares the peer dead in the peer table (see
    `TcpTransport`, "Peer death") and the thread ends; later jobs are dropped. `stop`
    (endpoint close or peer death) wakes both threads.
    The bulk lane's frames are sized by a `FramePace` (with `frame_s` > 0); the control lane
    sends whole jobs.
    """

    def __init__(self, peer: PeerId, lane: Lane, options: TcpOptions,
                 handshake: BoundHandshake, writer: JobWriter, peers: PeerTable) -> None:
        self.peer, self._options, self._handshake = peer, options, handshake
        self._writer, self._peers = writer, peers
        self.sock: socket.socket | None = None  # the wire's socket, once dialed
        self._stopping = threading.Event()
        self.jobs = SendQueue(options.max_queued)
        paced = lane == "bulk" and options.frame_s > 0
        self._pace = FramePace(options.frame_s) if paced else None
        self._unsent = 0  # the socket's TCP_NOTSENT_LOWAT, once set
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"pdserve-tcp-{lane}-{peer.host}:{peer.port}")
        self.thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    @property
    def full_rate(self) -> int:
        """The kernel's latest delivery rate of this connection while the sender was not
        application-limited, bytes/s (`FramePace`); 0 before any, or without frames."""
        return 0 if self._pace is None else self._pace.full_rate

    def stop(self) -> None:
        self._stopping.set()
        self.jobs.stop()
        shut(self.sock)

    def _dial(self) -> Wire | None:
        """The handshaken connection, or None once stopped. Raises what gives the peer up."""
        redials = self._options.handshake_redials
        for attempt in range(redials + 1):
            self.sock = self._connect()  # before the handshake: `stop` can wake it
            if self.stopped:
                return None
            try:
                return self._handshake.dial(self.sock, self.peer)
            except HandshakeCut as e:
                if attempt == redials or self.stopped:
                    raise
                log.info("dialing %s again (%d of %d): %s", self.peer, attempt + 1, redials, e)
            if self._stopping.wait(self._options.handshake_timeout_s / 2):
                return None
        return None  # not reached: the last attempt returns or raises

    def _connect(self) -> socket.socket:
        """A TCP connection to the peer's address within `dial_timeout_s`, keepalive on, with
        the congestion control asked for where the kernel gives it."""
        sock = socket.create_connection((self.peer.host, self.peer.port),
                                        self._options.dial_timeout_s)
        try:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if (refused := self._options.congestion_control(sock)) is not None:
                log.info("the connection to %s keeps the host's congestion control, not %s: "
                         "%s", self.peer, self._options.congestion, refused)
            self._options.keep_alive(sock)
        except OSError:
            shut(sock)
            raise
        return sock

    def _run(self) -> None:
        try:
            wire = self._dial()
            if wire is None or self.stopped:
                return
            threading.Thread(target=self._watch, daemon=True,
                             name=f"pdserve-tcp-watch-{self.peer.port}").start()
            while (job := self.jobs.get()) is not None and not self.stopped:
                self._limit_unsent(wire.sock)
                rest = self._writer.run(wire, self.peer, job, self._pace)
                if rest is not None:
                    self.jobs.resume(rest)
        except PeerReplaced as e:
            self._peers.died(self.peer, str(e))
        except (OSError, EOFError, ValueError) as e:
            if not self.stopped:  # a protocol error is no lost link
                self._peers.died(self.peer, f"sending to it failed: {e}",
                                 lost=not isinstance(e, ValueError))
        finally:
            shut(self.sock)

    def _limit_unsent(self, sock: socket.socket) -> None:
        """Keep the socket's unsent bytes at about one frame (set again when the frame size
        moved by 2x or more since)."""
        if self._pace is None:
            return
        want = self._pace.bytes
        if not self._unsent or not self._unsent / 2 < want < 2 * self._unsent:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, want)
            self._unsent = want

    def _watch(self) -> None:
        sock = self.sock
        with contextlib.suppress(OSError):
            while sock is not None and sock.recv(1 << 12):
                pass  # the acceptor never sends after HELLO_ACK; ignore stray bytes
        if not self.stopped:
            self._peers.died(self.peer, "connection closed by the peer", lost=True)
