"""Shaped links, measured with real TCP and UDP between hosts: the rate is what was asked (TCP
goodput is ~0.95 of a link's rate; the bounds are generous both ways), changes live, loss
drops that share of datagrams, a partition cuts exactly one pair of hosts, and a delay (netem's,
or the user-space delay line's where the kernel has no netem) shows in the round trip, changes
live, and jitters."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from pdserve.testbed import delays, lifecycle
from pdserve.testbed.namespaces import TestbedError, entered
from pdserve.testbed.probe import ProbeLimits, measure
from pdserve.testbed.state import BedState, DelayMethod
from pdserve.testbed.topology import LinkShape

HOSTS = ("router", "p0", "d0")
PROBE = ProbeLimits(seconds=1.0, max_bytes=64 << 20, pings=20, timeout_s=5.0)
SO_RCVBUFFORCE = 33  # Linux (root: past net.core.rmem_max); not in Python's socket module
CUT = ProbeLimits(seconds=0.2, max_bytes=1 << 20, pings=1, timeout_s=2.0)


def _assert_rate(bed: BedState, src: str, dst: str, gbps: float) -> None:
    m = measure(bed, src, dst, PROBE)
    assert 0.5 * gbps < m.gbps < 1.15 * gbps, f"{src} -> {dst}: {m} for a {gbps} Gb/s link"


def test_the_measured_rate_is_the_links_and_follows_a_live_change(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=0.2))
    _assert_rate(bed, "p0", "d0", 0.2)
    bed = lifecycle.set_link(bed.topology.prefix, "d0", gbps=0.05)
    assert bed.links["d0"] == LinkShape(gbps=0.05)
    _assert_rate(bed, "p0", "d0", 0.05)  # into d0: its link is the slower one
    _assert_rate(bed, "d0", "router", 0.05)  # out of d0 too
    _assert_rate(bed, "router", "p0", 0.2)  # the other links keep their rate


def test_an_unshaped_round_trip_is_short(make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=1))
    assert measure(bed, "p0", "d0", PROBE).rtt_ms < 20


def _can_delay(bed: BedState) -> None:
    if bed.delay is DelayMethod.NONE:
        with pytest.raises(TestbedError, match="can delay no link"):
            lifecycle.set_link(bed.topology.prefix, "d0", delay_ms=5)
        pytest.skip("no netem in this kernel and no iptables NFQUEUE: links cannot delay")


def test_delay_shows_in_the_round_trip_and_changes_live(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=1))
    _can_delay(bed)
    for host in ("p0", "d0"):
        bed = lifecycle.set_link(bed.topology.prefix, host, delay_ms=5)
    rtt = measure(bed, "p0", "d0", PROBE).rtt_ms
    assert 9 < rtt < 40, f"round trip {rtt} ms between two 5 ms links (one way 5 ms)"
    assert measure(bed, "p0", "router", PROBE).rtt_ms >= 4.5  # half of p0's 5 ms each way
    bed = lifecycle.set_link(bed.topology.prefix, "d0", delay_ms=25)
    rtt = measure(bed, "p0", "d0", PROBE).rtt_ms
    assert 29 < rtt < 80, f"round trip {rtt} ms between a 5 ms and a 25 ms link (one way 15)"


def test_jitter_varies_the_round_trip_within_its_bounds(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=1))
    _can_delay(bed)
    for host in HOSTS:
        bed = lifecycle.set_link(bed.topology.prefix, host, delay_ms=20, jitter_ms=20)
    rtts = [measure(bed, "p0", "d0", CUT).rtt_ms for _ in range(12)]
    # each way 20 ms +- 10 (two links, each +- 5): round trips 20-60 ms, not all alike
    assert min(rtts) >= 19 and max(rtts) - min(rtts) > 3, rtts


def test_the_delay_line_ends_when_no_link_delays_and_down_leaves_nothing(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=1))
    _can_delay(bed)
    for host in HOSTS:
        bed = lifecycle.set_link(bed.topology.prefix, host, delay_ms=10)
    if bed.delay is not DelayMethod.QUEUE:
        pytest.skip(f"the links delay by {bed.delay.value}, not the delay line")
    switch = bed.topology.switch_namespace
    assert delays.running(switch)
    for host in HOSTS:
        bed = lifecycle.set_link(bed.topology.prefix, host, delay_ms=0)
    deadline = time.monotonic() + 5
    while delays.running(switch) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not delays.running(switch)
    assert measure(bed, "p0", "d0", PROBE).rtt_ms < 5


def test_loss_drops_that_share_of_datagrams(make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=1))
    # neighbours resolved first: a lost ARP exchange would drop a whole burst, not 30% of it
    assert _udp_datagrams(bed, "p0", "d0", 20) == 20
    bed = lifecycle.set_link(bed.topology.prefix, "d0", loss_pct=30)
    received = _udp_datagrams(bed, "p0", "d0", 1000)
    assert 550 < received < 850, f"{received} of 1000 datagrams over a 30% loss link"


def test_a_partition_cuts_one_pair_until_healed(make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(HOSTS, LinkShape(gbps=1))
    prefix = bed.topology.prefix
    bed = lifecycle.partition(prefix, "d0", "p0")
    assert bed.cut_from("p0") == ("d0",)
    for src, dst in (("p0", "d0"), ("d0", "p0")):
        with pytest.raises(TestbedError):
            measure(bed, src, dst, CUT)
    assert measure(bed, "router", "d0", CUT).bytes > 0
    assert measure(bed, "p0", "router", CUT).bytes > 0
    bed = lifecycle.heal(prefix)
    assert bed.partitions == frozenset()
    assert measure(bed, "p0", "d0", CUT).bytes > 0


def _udp_datagrams(bed: BedState, src: str, dst: str, count: int) -> int:
    """How many of `count` small datagrams from `src` reach `dst` (paced, about 0.3 s)."""
    t = bed.topology
    with entered(t.namespace(dst)), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)  # holds them all
        rx.bind((t.address(dst), 0))
        rx.settimeout(1.0)
        with entered(t.namespace(src)), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for _ in range(count):
                tx.sendto(b"x" * 64, rx.getsockname())
                time.sleep(0.0003)
        received = 0
        try:
            while received < count:
                rx.recv(128)
                received += 1
        except TimeoutError:
            pass
        return received
