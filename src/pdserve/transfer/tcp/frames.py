"""Framing and zero-copy socket I/O of the TCP transport.

Every frame is a 32-byte header then `payload_len` bytes:

    offset 0  u8      frame type (`Frame`)
           1  3 bytes reserved, 0
           4  u32 LE  count (blocks in WRITE / READ_REQUEST / READ_DATA, else 0)
           8  u64 LE  transfer id
          16  u64 LE  move id (the writer's or reader's handle; 0 for HELLO / CONTROL)
          24  u64 LE  payload length

    HELLO, HELLO_ACK  HandshakeAuth envelope around the JSON body of `hello.Greeting`
                      (kind, sender, intended receiver, cipher; an ACK also names its HELLO)
    CONTROL           one wire message, delivered by `receive()` with the authenticated source
    WRITE             u32 first layer, u32 end layer, u32 dst block ids[count], then for each
                      block its layers [first, end): count * (end - first) * layer_nbytes raw
                      bytes (a block's layer slices are contiguous in the pool)
    WRITE_DONE/ERROR  the receiver's answer to a WRITE (ERROR payload: UTF-8 reason; a WRITE
                      outside the receiver's permits is drained and answered "not permitted")
    READ_REQUEST      u32 src block ids[count] of the holder's pool
    READ_DATA         u32 first layer, u32 end layer, u32 src block ids[count] (the ids the
                      READ_REQUEST named), then for each block its layers [first, end), as in
                      WRITE. A read's answer is one or more READ_DATA frames, in order, each
                      starting at the (block, layer) slice where the last one ended (several
                      blocks only whole); the requester lands them in its dst blocks
    READ_ERROR        the holder cannot serve a READ_REQUEST (payload: UTF-8 reason; one
                      outside the holder's permits is answered "not permitted")

Anything else (unknown type, a length that is not exactly what the header implies, a block id
out of the registered pool, an answer for a move the peer does not own) is a protocol error.
Block bytes go out with `sendmsg` over views of the pool and come in with `recv_into` straight
into the pool: no staging copy on either side.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Sequence
from enum import IntEnum

HEADER = struct.Struct("<B3xIQQQ")
MAX_CONTROL_BYTES = 1 << 20
MAX_SMALL_BYTES = 1 << 12
try:
    IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (ValueError, OSError):
    IOV_MAX = 1024


class Frame(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    CONTROL = 3
    WRITE = 4
    WRITE_DONE = 5
    WRITE_ERROR = 6
    READ_REQUEST = 7
    READ_DATA = 8
    READ_ERROR = 9


class ProtocolError(ValueError):
    """A peer sent something this protocol does not allow; its connection is dropped."""


class HandshakeCut(ConnectionError):
    """The acceptor closed or reset a dialed connection before its HELLO_ACK arrived: it
    refused the HELLO, or it was at its connection limit. Nothing authenticated happened."""


class PeerReplaced(ConnectionError):
    """Another instance answered, authenticated, at the dialed peer's address: the dialed
    instance is gone (it restarted). The message is why, for the peer table."""


# -- sockets -------------------------------------------------------------------------------------


def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Scatter-gather send of every buffer, at most IOV_MAX per `sendmsg`, no joining copy."""
    bufs = [memoryview(b).cast("B") for b in buffers]
    start = 0
    while start < len(bufs):
        sent = sock.sendmsg(bufs[start : start + IOV_MAX])
        while sent and sent >= len(bufs[start]):
            sent -= len(bufs[start])
            start += 1
        if sent:
            bufs[start] = bufs[start][sent:]
        while start < len(bufs) and not len(bufs[start]):
            start += 1


def recv_into_all(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket; EOF before it is full raises ConnectionError. With a
    `deadline` (time.monotonic()), all of it by then however slowly it trickles in, else
    TimeoutError (the socket is left with a timeout set)."""
    want = len(view)
    while len(view):
        try:
            if deadline is not None:
                settimeout_by(sock, deadline)
            n = sock.recv_into(view)
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"the deadline passed with {want - len(view)} of {want} bytes of "
                               "the frame received") from None
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        view = view[n:]


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf), deadline)
    return bytes(buf)


def settimeout_by(sock: socket.socket, deadline: float) -> None:
    """Set the socket's timeout to what is left until `deadline` (time.monotonic());
    TimeoutError when nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    sock.settimeout(left)


def drain(sock: socket.socket, n: int) -> None:
    """Read and discard n bytes (a cancelled read's data)."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n:
        chunk = scratch[: min(n, len(scratch))]
        recv_into_all(sock, chunk)
        n -= len(chunk)


def header(ftype: Frame, count: int = 0, tid: int = 0, mid: int = 0, plen: int = 0) -> bytes:
    return HEADER.pack(int(ftype), count, tid, mid, plen)


def parse_header(raw: bytes) -> tuple[Frame, int, int, int, int]:
    """Unpack a header; an unknown type raises ProtocolError."""
    ftype, count, tid, mid, plen = HEADER.unpack(raw)
    try:
        return Frame(ftype), count, tid, mid, plen
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None


def shut(sock: socket.socket | None) -> None:
    """Shut down and close, ignoring errors (wakes threads blocked on the socket)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def u32s(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def parse_u32s(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 4}I", raw)
