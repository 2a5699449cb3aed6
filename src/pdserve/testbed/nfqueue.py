"""The kernel's netfilter queue (NFQUEUE) over netlink, as much of it as a delay line needs.

A packet that an iptables rule sends to queue Q waits in the kernel until the program bound
to Q gives its verdict (accept or drop); the program sees its metadata only (COPY_META: the
packet id and the devices it came in and goes out on, not its bytes). GSO packets are passed
whole (flag F_GSO), so a TCP flow costs one verdict per segment of up to 64 KiB, not per
1,500-byte frame. With `iptables ... -j NFQUEUE --queue-bypass`, packets pass untouched while
no program is bound, so a delay line that dies leaves the link working, undelayed.

Wire format (linux/netfilter/nfnetlink_queue.h): netlink header, nfgenmsg (family, version,
queue number in network order), then attributes (length, type, payload padded to 4 bytes);
the queue's structs are in network byte order.

Lifetime: one `Queue` per process, bound until closed; not thread-safe.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
_SUBSYS_QUEUE = 3
_MSG_PACKET, _MSG_VERDICT, _MSG_CONFIG = 0, 1, 2
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_CMD_BIND = 1
_COPY_META = 1
_F_GSO = 1 << 2
# attributes
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN, _CFG_MASK, _CFG_FLAGS = 1, 2, 3, 4, 5
_PACKET_HDR, _VERDICT_HDR, _PHYSINDEV, _PHYSOUTDEV = 1, 2, 7, 8  # NFQA_IFINDEX_PHYS*
_NLA_TYPE_MASK = 0x3FFF  # without the nested and byte-order flag bits
NF_DROP, NF_ACCEPT = 0, 1
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_GENMSG = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (network order, packed)
RECV_BYTES = 1 << 18
MAX_SEND_BYTES = 1 << 16


class QueueError(OSError):
    """The kernel refused to bind or configure the queue."""


@dataclass(frozen=True)
class Packet:
    """One queued packet: its id (for the verdict) and the bridge ports it came in on and
    goes out of (ifindexes; 0 where the packet was not bridged)."""

    packet_id: int
    in_port: int
    out_port: int


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def message(kind: int, queue: int, attrs: bytes, flags: int = _NLM_F_REQUEST) -> bytes:
    """One nfnetlink queue message for `queue` (kind: _MSG_CONFIG or _MSG_VERDICT)."""
    body = _GENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return _HEADER.pack(_HEADER.size + len(body), (_SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body


def verdict(queue: int, packet_id: int, accept: bool = True) -> bytes:
    return message(_MSG_VERDICT, queue, _attr(
        _VERDICT_HDR, struct.pack(">II", NF_ACCEPT if accept else NF_DROP, packet_id)))


def _attrs(data: bytes, start: int, end: int) -> Iterator[tuple[int, int]]:
    """(type, payload offset) of each attribute in data[start:end]."""
    at = start
    while at + 4 <= end:
        size, kind = struct.unpack_from("=HH", data, at)
        if size < 4:
            return
        yield kind & _NLA_TYPE_MASK, at + 4
        at += (size + 3) & ~3


def packets(data: bytes) -> Iterator[Packet]:
    """The packets announced in one netlink read (other messages skipped)."""
    at = 0
    while at + _HEADER.size <= len(data):
        size, kind = _HEADER.unpack_from(data, at)[:2]
        if size < _HEADER.size:
            return
        if kind == (_SUBSYS_QUEUE << 8) | _MSG_PACKET:
            # each a 32-bit first field: the packet header's id, or an ifindex
            found = {attr: struct.unpack_from(">I", data, offset)[0] for attr, offset in
                     _attrs(data, at + _HEADER.size + _GENMSG.size, at + size)
                     if attr in (_PACKET_HDR, _PHYSINDEV, _PHYSOUTDEV)}
            if _PACKET_HDR in found:
                yield Packet(found[_PACKET_HDR], found.get(_PHYSINDEV, 0),
                             found.get(_PHYSOUTDEV, 0))
        at += (size + 3) & ~3


class Queue:
    """Bound to queue number `queue` in the calling process's network namespace."""

    def __init__(self, queue: int, max_packets: int = 65536, rcvbuf: int = 32 << 20,
                 blocking: bool = True) -> None:
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
            self.sock.bind((0, 0))
            self._configure(_attr(_CFG_CMD, struct.pack(">BBH", _CMD_BIND, 0, 0)))
            self._configure(_attr(_CFG_PARAMS, struct.pack(">IB", 0, _COPY_META)))
            self._configure(_attr(_CFG_QUEUE_MAXLEN, struct.pack(">I", max_packets)))
            self._configure(_attr(_CFG_MASK, struct.pack(">I", _F_GSO))
                            + _attr(_CFG_FLAGS, struct.pack(">I", _F_GSO)))
            self.sock.setblocking(blocking)
        except BaseException:
            self.sock.close()
            raise

    def _configure(self, attrs: bytes) -> None:
        self.sock.send(message(_MSG_CONFIG, self.queue, attrs, _NLM_F_REQUEST | _NLM_F_ACK))
        reply = self.sock.recv(4096)
        _, kind = _HEADER.unpack_from(reply)[:2]
        error = struct.unpack_from("=i", reply, _HEADER.size)[0] if kind == _NLMSG_ERROR else 0
        if error:
            raise QueueError(-error, f"binding netfilter queue {self.queue}: "
                                     f"{os.strerror(-error)}")

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[Packet]:
        """The packets of one read (blocks unless the socket is non-blocking)."""
        return list(packets(self.sock.recv(RECV_BYTES)))

    def accept(self, packet_ids: list[int]) -> None:
        """Let these packets go on, in this order, a few sends of many verdicts each."""
        batch = b""
        for pid in packet_ids:
            batch += verdict(self.queue, pid)
            if len(batch) >= MAX_SEND_BYTES:
                self.sock.send(batch)
                batch = b""
        if batch:
            self.sock.send(batch)

    def close(self) -> None:
        self.sock.close()
