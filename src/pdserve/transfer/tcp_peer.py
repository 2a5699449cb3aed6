"""The TCP transport's moves and its one outgoing connection per peer instance."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.transfer.descriptors import PeerId
from pdserve.transfer.tcp_frames import HandshakeCut, shut
from pdserve.transfer.transport import MoveHandle, MoveStatus

if TYPE_CHECKING:
    from pdserve.transfer.tcp import TcpTransport
    from pdserve.transfer.tcp_wire import Wire

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Move:
    """One write or read. Guarded by the transport's lock. `busy` is true while a thread sends
    (write) or lands (read) its bytes on `sock`; `cancelled` stops it before the next step."""

    handle: MoveHandle
    kind: str  # "write" | "read"
    transfer_id: int
    peer: PeerId
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    layers: tuple[int, int] | None = None  # a write's [first, end) layers; None: every layer
    status: MoveStatus = "pending"
    cancelled: bool = False
    busy: bool = False
    sock: socket.socket | None = field(default=None, repr=False)


Job = tuple  # ("control", bytes) | ("move", Move) | ("read_data", tid, mid, ids) | ("answer", ..)


class PeerSender:
    """The one outgoing connection to one peer instance and its daemon sender thread.

    The thread dials on its first job (HELLO, then waits for the signed HELLO_ACK however long a
    stalled peer takes, see `TcpOptions`), then sends queued jobs strictly in order on that one
    connection. A connection the peer's address closes before any HELLO_ACK (it refused us, or
    was at its connection limit: nothing authenticated) is dialed again, up to
    `handshake_redials` times, with the jobs kept queued. A second daemon thread watches the
    connection: the acceptor never sends after HELLO_ACK, so EOF or reset means the peer is gone.
    Any other failure, or the last cut handshake, reports the peer dead to the transport (see
    `TcpTransport`, "Peer death") and the thread ends; later jobs are dropped. `stop`
    (transport close or peer death) wakes both threads.
    """

    def __init__(self, tx: TcpTransport, peer: PeerId) -> None:
        self.tx, self.peer = tx, peer
        self.sock: socket.socket | None = None  # the wire's socket, once dialed
        self._stopping = threading.Event()
        self._jobs: queue.Queue[Job | None] = queue.Queue(tx.options.max_queued)
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"pdserve-tcp-send-{peer.host}:{peer.port}")
        self.thread.start()

    def put(self, job: Job) -> bool:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        shut(self.sock)

    def _dial(self) -> Wire | None:
        """The handshaken connection, or None once stopped. Raises what gives the peer up."""
        redials = self.tx.options.handshake_redials
        for attempt in range(redials + 1):
            self.sock = self.tx.connect(self.peer)  # before the handshake: `stop` can wake it
            if self.stopped:
                return None
            try:
                return self.tx.handshake(self.sock, self.peer)
            except HandshakeCut as e:
                if attempt == redials or self.stopped:
                    raise
                log.info("dialing %s again (%d of %d): %s", self.peer, attempt + 1, redials, e)
            if self._stopping.wait(self.tx.options.handshake_timeout_s / 2):
                return None
        return None  # not reached: the last attempt returns or raises

    def _run(self) -> None:
        try:
            wire = self._dial()
            if wire is None or self.stopped:
                return
            threading.Thread(target=self._watch, daemon=True,
                             name=f"pdserve-tcp-watch-{self.peer.port}").start()
            while (job := self._jobs.get()) is not None and not self.stopped:
                self.tx.run_job(wire, self.peer, job)
        except (OSError, EOFError, ValueError) as e:
            if not self.stopped:
                self.tx.peer_died(self.peer, f"sending to it failed: {e}")
        finally:
            shut(self.sock)

    def _watch(self) -> None:
        sock = self.sock
        with contextlib.suppress(OSError):
            while sock is not None and sock.recv(1 << 12):
                pass  # the acceptor never sends after HELLO_ACK; ignore stray bytes
        if not self.stopped:
            self.tx.peer_died(self.peer, "connection closed by the peer")
