"""`TcpOptions`: the TCP transport's timeouts and limits, validated at construction."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pdserve.transfer.tcp.hello import CIPHERS

CA_NAME_MAX = 16  # TCP_CA_NAME_MAX in include/net/tcp.h, with the terminating zero


@dataclass(frozen=True)
class TcpOptions:
    """Timeouts and limits. `cancel_wait_s` bounds how long `cancel` waits for a frame that is
    being sent or received before it shuts that connection down; `max_queued` bounds each peer's
    send queue (a full queue drops control messages and fails new moves). `encrypt` seals
    every connection after its handshake with AES-256-GCM (`wire.py`); peers must agree,
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
    instance that talks to this endpoint holds two (the connections it dialed, see
    `control_connection`; this endpoint's to it are counted at the peer), and a connection
    that has not authenticated holds its slot for at most `handshake_timeout_s`: keep it above
    twice the number of workers.

    `control_connection` sends control messages, the answers to a peer's moves and read
    requests on a connection of their own to each peer, beside the one that carries bulk data
    (`send_side.py`), so they wait for no bulk byte and no bulk congestion window: on a 1 Gb/s
    testbed link full of 32 writes, with the host's BBR, it took the control P99 from 40.8 ms
    to 9.5 ms (medians of nine runs), what raw sockets beside the full link got
    (docs/testbed.md). Off: one connection per peer carries both.

    `frame_s` cuts a write into WRITE frames, and the answer to a read into READ_DATA frames,
    of about that many seconds of the connection's measured send rate, and caps the bytes its
    socket holds not yet sent (TCP_NOTSENT_LOWAT) to one frame (`frame_pace.py`): a message
    queued behind bulk data on the same connection (without `control_connection`) waits for
    about 2 x `frame_s` plus what is already in flight (`send_queue.py`). It is also the
    queueing that peers writing into this endpoint at once may add together: with two or more
    sending bulk data, each gets an equal receive window of the measured rate x (round trip +
    `frame_s`) split among them (`incoming_share.py`). 0: one frame a write or a read and the
    kernel's unsent limit (megabytes), the order of arrival only, and the kernel's own receive
    windows.

    `congestion` is the TCP congestion control asked for on every connection this endpoint
    dials (all it sends goes out on those; Linux's TCP_CONGESTION), "" (the default) for the
    host's. Neither common choice wins everywhere (measured on the testbed, docs/testbed.md):
    BBR (v1, Linux's `tcp_bbr`) enters PROBE_RTT after 10 s without a lower round trip, which
    a connection that always keeps a queue never sees, and holds 4 segments for 200 ms (a
    190-220 ms stall of the bulk connection in half the 6 s bursts of 32 writes on a 1 Gb/s,
    2 ms link, which `control_connection` keeps control messages out of); CUBIC has no such
    stall (the receiver's window above bounds its queue), but halves its window on every loss,
    and with 0.1% random loss on that link a burst of 8 writes took 2.6x the ideal (BBR 1.07x),
    with 1% 31x. Keep the host's where links drop packets.
    Where the kernel lacks the one asked for, or refuses it (not in
    `net.ipv4.tcp_allowed_congestion_control` and no CAP_NET_ADMIN), the connection keeps the
    host's default and says so in the log."""

    dial_timeout_s: float = 1.0
    handshake_timeout_s: float = 2.0
    handshake_redials: int = 4
    cancel_wait_s: float = 5.0
    max_queued: int = 10_000
    max_connections: int = 128
    encrypt: bool = False
    keepalive_idle_s: int = 5
    keepalive_interval_s: int = 1
    keepalive_probes: int = 5
    frame_s: float = 0.002
    congestion: str = ""
    control_connection: bool = True

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
        if not self.frame_s >= 0:
            raise ValueError(f"TcpOptions.frame_s must be >= 0 (0: whole writes), got "
                             f"{self.frame_s!r}")
        if self.max_queued < 1:
            raise ValueError(f"TcpOptions.max_queued must be >= 1, got {self.max_queued}")
        if not (self.congestion.isascii() and self.congestion.isprintable()
                and len(self.congestion) < CA_NAME_MAX and " " not in self.congestion):
            raise ValueError(f"TcpOptions.congestion must be a congestion control's name "
                             f"(under {CA_NAME_MAX} characters, e.g. cubic) or \"\" for the "
                             f"host's default, got {self.congestion!r}")

    def congestion_control(self, sock: socket.socket) -> str | None:
        """Ask for `congestion` on `sock`, before it sends; None where that held (or none
        was asked), else why the host's default stays."""
        if not self.congestion:
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.congestion.encode())
        except OSError as e:
            return e.strerror or str(e)
        return None

    def keep_alive(self, sock: socket.socket) -> None:
        """Turn on TCP keepalive on `sock` with these idle, interval and probe settings."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.keepalive_idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.keepalive_interval_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.keepalive_probes)
