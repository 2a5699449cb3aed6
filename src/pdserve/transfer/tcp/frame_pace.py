"""How big one connection's bulk frames are: about `frame_s` of the link's delivery rate.

A control message waits behind at most the frame on the wire plus the socket's unsent bytes
(`send_queue.py`), so both follow the link: on a 1 Gb/s link 2 ms is 250 KB, on loopback at
2 GB/s it is 4 MB (small frames there cost more in per-frame work than they save). The rate
is the kernel's own estimate for the connection, TCP_INFO's `tcpi_delivery_rate` (Linux 4.9+;
bytes acknowledged per second over recent round trips, the BBR paper's delivery rate, Cardwell
et al. 2016), read after each bulk frame. Timing our own sends instead would read the speed of
copying into a socket buffer that is not yet full and grow the frames without bound. Where
the kernel gives no rate (another OS, no data acknowledged yet), the size stays at `START`.

The same reading keeps `full_rate`, the latest delivery rate the kernel measured while the
sender was not application-limited (the link's rate for a sender with enough to send): the
worker's link report (`send_side.PeerSender.links`) gives it between transfers, when the
kernel's current sample is the app-limited one of the transfer's tail or a control message.

Invariant: `MIN_BYTES <= bytes <= MAX_BYTES`. One per connection, written by its sender thread
only (`full_rate` is read by others: one int, replaced whole).
"""

from __future__ import annotations

import socket

from pdserve.transfer.tcp.tcp_info import tcp_info

MIN_BYTES = 64 * 1024
MAX_BYTES = 16 * 1024 * 1024
START = 256 * 1024


class FramePace:
    def __init__(self, frame_s: float) -> None:
        self._frame_s = frame_s
        self.bytes = START
        self.full_rate = 0  # bytes/s; 0 until a sample not limited by the sender

    def observe(self, sock: socket.socket) -> None:
        """Size the next frame from the connection's current delivery rate."""
        info = tcp_info(sock)
        rate = 0 if info is None else info.delivery_rate
        if rate:
            self.bytes = max(MIN_BYTES, min(MAX_BYTES, int(rate * self._frame_s)))
            if info is not None and not info.app_limited:
                self.full_rate = rate


def delivery_rate(sock: socket.socket) -> int:
    """The kernel's delivery rate of `sock` in bytes per second; 0 where it gives none."""
    info = tcp_info(sock)
    return 0 if info is None else info.delivery_rate
