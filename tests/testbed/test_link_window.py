"""Transfers that respect the link, across two testbed hosts (`pdserve bench transfer
--testbed`'s measurements): control messages do not wait behind a burst of KV writes when the
link window is on, and do when it is off (whole writes, kernel buffers); either way the burst
keeps the link busy; tcp and NIXL (UCX kept on the link) pushes fill most of it, as a plain
TCP socket over the same path does; the raw sockets' burst baseline (one stream, stamps on a
second connection) keeps the link as busy and its stamps do not wait behind the stream."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.bench import link_bench, link_raw
from pdserve.testbed.state import BedState
from pdserve.testbed.topology import LinkShape

SHAPE = LinkShape(gbps=1)
BURST = 4
REPEATS = 3  # the link-busy checks take the median burst: one stalled repeat does not decide


def test_control_messages_pass_a_burst_of_writes_only_with_the_window(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(("p0", "d0"), SHAPE)
    on = link_bench.burst(bed.topology, SHAPE, window=True, concurrent=BURST, repeats=REPEATS)
    off = link_bench.burst(bed.topology, SHAPE, window=False, concurrent=BURST,
                           repeats=REPEATS)
    one_write_ms = on.ideal_ms / BURST  # one write's bytes at the link's rate
    assert on.control_messages > 10 and off.control_messages > 10
    assert on.control_p99_ms < one_write_ms / 4, on
    assert off.control_p50_ms > one_write_ms / 4, off
    for row in (on, off):  # FIFO per peer: the last write ends near N x one write's time
        assert row.last_of_ideal < 1.5, row


def test_the_raw_burst_baseline_fills_the_link_with_stamps_beside_it(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(("p0", "d0"), SHAPE)
    raw = link_bench.raw_burst(bed.topology, SHAPE, concurrent=BURST, repeats=REPEATS)
    one_write_ms = raw.ideal_ms / BURST
    assert raw.transport == "raw" and raw.concurrent == BURST
    assert raw.control_messages > 10, raw
    assert raw.control_p50_ms < one_write_ms / 4, raw
    assert 0.9 < raw.last_of_ideal < 1.5, raw  # the shaped link's rate bounds the stream


def test_bulk_writes_fill_most_of_the_link_as_a_raw_socket_does(
        make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(("p0", "d0"), SHAPE)
    with link_raw.raw_path(bed.topology, link_bench.PROMPT_BYTES) as raw:
        base = link_bench.raw_bulk(SHAPE, repeats=2, raw=raw)
        row = link_bench.bulk(bed.topology, SHAPE, "tcp", repeats=2, raw=raw)
    assert base.transport == "raw" and base.of_link > 0.6, base
    assert row.of_link > 0.6 and row.of_raw > 0.6, row


def test_nixl_pushes_across_hosts_fill_most_of_the_link(make_bed: Callable[..., BedState]) -> None:
    pytest.importorskip("nixl_cu12")
    bed = make_bed(("p0", "d0"), SHAPE)
    with link_raw.raw_path(bed.topology, link_bench.PROMPT_BYTES) as raw:
        row = link_bench.nixl_bulk(bed.topology, SHAPE, repeats=2, raw=raw)
    assert row.transport == "nixl" and row.of_link > 0.6 and row.of_raw > 0.6, row
