"""The host-wide fair share of an endpoint's incoming link among the peers sending bulk data
into it at once (incast: several prefill hosts pushing KV into one decode host).

Why: each sender's own window (`frame_pace.py`) bounds the bytes its socket holds unsent,
not the bytes in flight; those are its congestion control's. Measured on the testbed
(`pdserve bench transfer --testbed --senders 3`, docs/testbed.md), three senders into one
1 Gb/s decode link overran its queue: ~9% of the segments were sent again (one sender: 0.07%),
retransmission timeouts (200 ms at least) stalled whole connections, control messages behind
them waited up to a quarter of a second, and one sender's share fell as low as 8%. Only the
receiving host sees every peer, and the one lever it has over a sender's bytes in flight is
the window it advertises (TCP_WINDOW_CLAMP), so the share is set here (the idea of ICTCP,
Wu et al., CoNEXT 2010).

The share: every `UPDATE_S` (checked as bulk frames arrive), the connections that carried a
WRITE or READ_DATA frame since the last update are the active ones, and each gets the same
window (TCP_WINDOW_CLAMP),

    max(MIN_BYTES, SEGMENTS x advmss, rate x (rtt + target_s) / active)

`rate` the host's incoming bytes per second (the highest of the updates in the last `PEAK_S`:
what the link delivered lately), `rtt` the largest of the active connections' smallest round
trips (TCP_INFO's `tcpi_min_rtt` on the accepted socket, in microseconds: sampled from the
handshake and the HELLO_ACK this end sent, on an idle connection, so the path's own; the
receiver's `tcpi_rcv_rtt` counts in milliseconds and includes the queue), `target_s` the
queueing the senders may add together (`TcpOptions.frame_s`). Equal windows share a FIFO
bottleneck equally; their sum, rate x (rtt + target), is a round trip's bytes (the path's
bandwidth-delay product) and `target_s` more, so the queue at the link stays near `target_s`
however many peers send, and below a switch's buffer of a few milliseconds. The `target_s`
also lets the rate grow where the link is faster than measured so far: the senders together
may send (rtt + target) / rtt times what the link delivered lately each round trip, more than
doubling it where the round trip is under `target_s` (a rack), 1.45x on a 4.4 ms round trip,
and the budget follows within an update. (A budget of 2 x rtt + target, which doubled in
every case, left a queue of a round trip plus `target_s`: on the testbed's 2 ms link 6.4 ms,
more than its 5 ms buffer, so segments were dropped and control messages waited for their
retransmission.) One sender alone gets the whole budget.

The floor: `advmss` is the largest segment the connection told its peer to send (TCP_INFO;
65,483 bytes on loopback, 1,448 on an Ethernet link). A window under one segment stops the
connection: Linux's receiver advertises a zero window while its free space is under one
segment (receiver-side silly-window avoidance, `__tcp_select_window`), the sender waits for
persist probes, the measured rate falls and the share with it (seen on loopback with a
16 KiB floor: 47 of 48 concurrent transfers outlived their lease). `SEGMENTS` segments keep
the window flowing.

A connection keeps its last window while idle: senders that start together after a pause
start within their last windows, not the kernel's megabytes (measured: with the kernel's own
windows back between bursts, the first update's 20 ms of each burst overran the queue
enough for a retransmission timeout in most runs). A new connection starts at the last
update's window from its handshake on (`joined`; the kernel's while no share is in force): a
peer that joins senders already sharing the link starts within a share, not the kernel's
megabytes.
After a pause longer than `STALE_S` the next update only starts a new measurement (the rate
over a pause says nothing of the link).

Invariant: after an update, every connection active since the one before has the same
window, the budget split among them, or its floor where that is larger. Thread-safe (the
reader threads call it); costs a lock per frame and, per update, a getsockopt per connection
and a setsockopt per active one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.transfer.tcp.tcp_info import tcp_info

UPDATE_S = 0.02
PEAK_S = 0.2
STALE_S = 3 * UPDATE_S
MIN_BYTES = 16 * 1024
SEGMENTS = 4


def share_bytes(rate: float, rtt_s: float, target_s: float, active: int) -> int:
    """Each active connection's window: the host's budget split evenly, at least MIN_BYTES."""
    return max(MIN_BYTES, int(rate * (rtt_s + target_s) / active))


@dataclass
class _Connection:
    """What the share keeps of one connection, from its first bulk frame to `forget`."""

    received: int  # its bytes received at the last update
    floor: int  # its smallest window (module docstring)
    rtt_us: int = 0  # the smallest round trip seen; 0: none yet


class IncomingShare:
    def __init__(self, target_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._target_s, self._clock = target_s, clock
        self._lock = threading.Lock()
        self._last = clock()
        self._known: dict[socket.socket, _Connection] = {}
        self._active: set[socket.socket] = set()  # a bulk frame since the last update
        self._rates: deque[tuple[float, float]] = deque()  # (when, bytes/s) of updates
        self.share = 0  # the window the last update gave each active connection; 0: none yet

    def joined(self, sock: socket.socket) -> None:
        """`sock`'s handshake is done: it starts at the current window, if a share is in force,
        before its first bulk frame."""
        with self._lock:
            self._know(sock)

    def arrived(self, sock: socket.socket) -> None:
        """A bulk frame was read from `sock`; update the shares if one is due."""
        with self._lock:
            self._know(sock)
            self._active.add(sock)
            now = self._clock()
            if now - self._last >= UPDATE_S:
                self._update(now)

    def _know(self, sock: socket.socket) -> None:
        if sock in self._known:
            return
        info = tcp_info(sock)
        self._known[sock] = _Connection(0 if info is None else info.bytes_received,
                                        max(MIN_BYTES, SEGMENTS * (info.advmss if info else 0)))
        if self.share:
            self._clamp(sock)

    def forget(self, sock: socket.socket) -> None:
        """`sock` is closed or closing: nothing of it is kept."""
        with self._lock:
            self._known.pop(sock, None)
            self._active.discard(sock)

    def _update(self, now: float) -> None:
        elapsed, self._last = now - self._last, now
        active, self._active = self._active, set()
        total = self._measure()
        if elapsed > STALE_S:  # after a pause: a new baseline, no rate from it
            return
        self._rates.append((now, total / elapsed))
        while self._rates[0][0] < now - PEAK_S:
            self._rates.popleft()
        rate = max(r for _, r in self._rates)
        if rate <= 0:
            return
        rtt_us = max((self._known[s].rtt_us for s in active if s in self._known), default=0)
        rtt_s = rtt_us / 1e6
        self.share = share_bytes(rate, rtt_s, self._target_s, len(active))
        for sock in active:
            self._clamp(sock)

    def _clamp(self, sock: socket.socket) -> None:
        known = self._known.get(sock)
        window = max(self.share, known.floor if known else MIN_BYTES)
        with contextlib.suppress(OSError):  # closing: its reader forgets it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, window)

    def _measure(self) -> int:
        """Bytes every known connection received since the last update; their round trips."""
        total = 0
        for sock, known in self._known.items():
            info = tcp_info(sock)
            if info is None:
                continue
            total += max(0, info.bytes_received - known.received)
            known.received = info.bytes_received
            if info.min_rtt_us:
                known.rtt_us = info.min_rtt_us
        return total
