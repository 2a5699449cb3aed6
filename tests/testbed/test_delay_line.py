"""The delay line's parts that need no namespace: the netlink messages it reads and writes,
and when it lets each packet go (half of each crossed link's delay, jitter within bounds, and
never ahead of the packet before it on the same path). The line at work on real links is in
test_links.py."""

from __future__ import annotations

import socket
import struct

import pytest

from pdserve.testbed import nfqueue
from pdserve.testbed.delay_line import Schedule
from pdserve.testbed.nfqueue import Packet
from pdserve.testbed.topology import LinkShape


def _packet_message(packet_id: int, physin: int | None, physout: int | None) -> bytes:
    """A queued-packet message as the kernel writes it (PACKET_HDR, then the bridge ports)."""
    attrs = nfqueue._attr(1, struct.pack(">IHB", packet_id, 0x0800, 2) + b"\0")
    attrs += nfqueue._attr(5, struct.pack(">I", 99))  # NFQA_IFINDEX_INDEV: the bridge
    if physin is not None:
        attrs += nfqueue._attr(7, struct.pack(">I", physin))  # NFQA_IFINDEX_PHYSINDEV
    if physout is not None:
        attrs += nfqueue._attr(8, struct.pack(">I", physout))  # NFQA_IFINDEX_PHYSOUTDEV
    return nfqueue.message(0, 0, attrs, flags=0)


def test_every_packet_of_a_read_is_found_with_its_ports() -> None:
    data = _packet_message(7, 3, 4) + _packet_message(8, None, None)
    assert list(nfqueue.packets(data)) == [Packet(7, 3, 4), Packet(8, 0, 0)]


def test_other_messages_and_a_truncated_tail_are_skipped() -> None:
    ack = struct.pack("=IHHII", 36, 2, 0, 0, 0) + b"\0" * 20  # an NLMSG_ERROR (ack)
    data = ack + _packet_message(9, 1, 2)
    assert list(nfqueue.packets(data + b"\x01\x02")) == [Packet(9, 1, 2)]


def test_a_verdict_accepts_that_packet_on_that_queue() -> None:
    msg = nfqueue.verdict(5, 1234)
    size, kind, flags = struct.unpack_from("=IHH", msg)
    assert size == len(msg) == 16 + 4 + 12 and kind == (3 << 8) | 1 and flags == 1
    family, version, queue = struct.unpack_from("=BBH", msg, 16)
    assert (family, version, socket.ntohs(queue)) == (socket.AF_UNSPEC, 0, 5)
    assert struct.unpack_from(">HHII", msg, 20)[2:] == (nfqueue.NF_ACCEPT, 1234)
    assert struct.unpack_from("=HH", msg, 20) == (12, 2)


SHAPES = {1: LinkShape(delay_ms=10), 2: LinkShape(delay_ms=30), 3: LinkShape(delay_ms=20,
                                                                            jitter_ms=8)}


def test_a_packet_waits_half_of_each_link_it_crosses() -> None:
    schedule = Schedule(rng=lambda: 0.5)  # jitter's middle: none
    assert schedule.release_s(100.0, Packet(1, 1, 2), SHAPES) == pytest.approx(100.020)
    assert schedule.release_s(100.0, Packet(2, 2, 9), SHAPES) == pytest.approx(100.015)
    assert schedule.release_s(100.0, Packet(3, 0, 0), SHAPES) == 100.0  # not bridged


@pytest.mark.parametrize(("draw", "wait_ms"), [(0.0, 6.0), (0.999999, 14.0)])
def test_jitter_spreads_half_the_links_jitter_each_way(draw: float, wait_ms: float) -> None:
    """Link 3: 20 ms +- 8 ms, so half of it each way: 10 +- 4 ms."""
    schedule = Schedule(rng=lambda: draw)
    assert schedule.release_s(0.0, Packet(1, 3, 99), SHAPES) == pytest.approx(wait_ms / 1e3,
                                                                              abs=1e-6)


def test_a_packet_never_leaves_before_the_one_ahead_on_its_path() -> None:
    draws = iter([0.999999, 0.0, 0.0])  # the first drawn late, the next two early
    schedule = Schedule(rng=lambda: next(draws))
    first = schedule.release_s(0.0, Packet(1, 3, 99), SHAPES)
    second = schedule.release_s(0.001, Packet(2, 3, 99), SHAPES)
    other_path = schedule.release_s(0.001, Packet(3, 99, 3), SHAPES)
    assert second == first == pytest.approx(0.014, abs=1e-6)  # not at 0.001 + 0.006
    assert other_path == pytest.approx(0.007, abs=1e-6)  # its own path: not held back
