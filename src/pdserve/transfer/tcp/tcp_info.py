"""The kernel's estimates for one TCP connection (Linux TCP_INFO, `struct tcp_info` in
include/uapi/linux/tcp.h), read without copying anything but the struct.

Offsets (bytes) of the fields read: the bit field holding `tcpi_delivery_rate_app_limited`
(bit 0 of byte 7), `tcpi_rtt` (u32 microseconds, 68), `tcpi_advmss` (u32 bytes, 84: the
largest segment this end told its peer to send), `tcpi_bytes_acked` (u64, 120),
`tcpi_bytes_received` (u64, 128), `tcpi_min_rtt` (u32 microseconds, 148),
`tcpi_delivery_rate` (u64 bytes per second, 160; Linux 4.9+). A kernel whose struct ends
before the delivery rate gives None.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_APP_LIMITED_AT, _RTT_AT, _ADVMSS_AT, _BYTES_ACKED_AT = 7, 68, 84, 120
_BYTES_RECEIVED_AT, _MIN_RTT_AT, _DELIVERY_RATE_AT = 128, 148, 160
_BYTES = _DELIVERY_RATE_AT + _U64.size


@dataclass(frozen=True)
class TcpInfo:
    delivery_rate: int  # bytes per second; 0 before any data was acknowledged
    app_limited: bool
    rtt_us: int
    min_rtt_us: int
    bytes_acked: int
    bytes_received: int = 0
    advmss: int = 0


def tcp_info(sock: socket.socket) -> TcpInfo | None:
    """The connection's estimates; None where the kernel gives none (another OS, a closed
    socket, an old kernel)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _BYTES)
    except OSError:
        return None
    if len(raw) < _BYTES:
        return None
    return TcpInfo(delivery_rate=_U64.unpack_from(raw, _DELIVERY_RATE_AT)[0],
                   app_limited=bool(raw[_APP_LIMITED_AT] & 1),
                   rtt_us=_U32.unpack_from(raw, _RTT_AT)[0],
                   min_rtt_us=_U32.unpack_from(raw, _MIN_RTT_AT)[0],
                   bytes_acked=_U64.unpack_from(raw, _BYTES_ACKED_AT)[0],
                   bytes_received=_U64.unpack_from(raw, _BYTES_RECEIVED_AT)[0],
                   advmss=_U32.unpack_from(raw, _ADVMSS_AT)[0])
