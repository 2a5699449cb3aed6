"""The workers' own link reports as the router trusts them: a recent rate not limited by the
sender stands in for a pair with no hand-over of its own (rtt + bytes / rate), an app-limited
or stale one does not, and the pair's own hand-overs win over any report."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.router.link_estimates import MEMORY_S, LinkEstimates, LinkSource
from pdserve.router.link_reports import LinkReports
from tests.router.test_link_estimates import MB, Clock


def report(peer: str = "10.0.0.9:7000", gbps: float | None = 0.08, nbytes: int = 5 * MB,
           rtt_ms: float | None = 2.0, app_limited: bool = False) -> dict[str, Any]:
    """One entry of a worker's /health `links` (0.08 Gb/s: 10 MB/s)."""
    return {"peer": peer, "source": "tcp_info", "gbps": gbps, "bytes_sent": nbytes,
            "rtt_ms": rtt_ms, "min_rtt_ms": 1.0, "app_limited": app_limited}


def reported(reports: LinkReports, worker: str = "p0", decode: str = "d0",
             peer: str = "10.0.0.9:7000") -> dict[tuple[str, str], Any]:
    """The trusted reports by (prefill, decode) pair, as `PathChoice` maps a peer to its
    worker."""
    return {(w, decode): fit for (w, p), fit in reports.fits().items() if p == peer}


def test_a_reported_slow_link_makes_an_unmeasured_pair_slow() -> None:
    clock = Clock()
    links, reports = LinkEstimates(clock), LinkReports(clock)
    links.observe("p1", "d0", 10 * MB, 0.01)  # p1's own hand-overs: 1 GB/s
    reports.observe("p0", [report(gbps=0.08, rtt_ms=2.0)])  # p0 says 10 MB/s, 2 ms
    table = links.table(reported(reports))
    assert table.seconds("p0", "d0", 10 * MB) == pytest.approx(0.002 + 1.0)
    assert table.estimate("p0", "d0")[1] is LinkSource.REPORT
    assert table.describe("p0", "d0") == "[report] 80.0 Mb/s + 2.0 ms (worker report)"
    # without the report it counted at the mean of the measured pairs: p1's 10 ms
    assert links.table().seconds("p0", "d0", 10 * MB) == pytest.approx(0.01)


def test_an_app_limited_report_is_no_bandwidth() -> None:
    clock = Clock()
    links, reports = LinkEstimates(clock), LinkReports(clock)
    links.observe("p1", "d0", 10 * MB, 0.01)
    reports.observe("p0", [report(gbps=0.001, app_limited=True)])
    table = links.table(reported(reports))
    assert table.estimate("p0", "d0") == (None, LinkSource.MEAN)
    assert table.seconds("p0", "d0", 10 * MB) == pytest.approx(0.01)
    # a trusted sample stays trusted when an app-limited one follows (a lower bound of it)
    reports.observe("p0", [report(gbps=0.08, nbytes=6 * MB)])
    reports.observe("p0", [report(gbps=0.001, nbytes=7 * MB, app_limited=True)])
    assert reported(reports)["p0", "d0"].bytes_per_s == pytest.approx(10 * MB)


def test_the_pair_s_own_hand_overs_win_over_its_report() -> None:
    clock = Clock()
    links, reports = LinkEstimates(clock), LinkReports(clock)
    links.observe("p0", "d0", 10 * MB, 0.05)  # 200 MB/s by its own hand-overs
    reports.observe("p0", [report(gbps=0.08)])
    table = links.table(reported(reports))
    assert table.seconds("p0", "d0", 10 * MB) == pytest.approx(0.05)
    assert table.estimate("p0", "d0")[1] is LinkSource.HANDOVERS


def test_a_report_whose_bytes_stop_moving_is_stale_after_memory_s() -> None:
    clock = Clock()
    reports = LinkReports(clock)
    reports.observe("p0", [report(nbytes=5 * MB)])  # first seen: a sample
    clock.now += MEMORY_S - 1
    reports.observe("p0", [report(nbytes=5 * MB)])  # the same bytes: the same old sample
    assert reported(reports)
    clock.now += 2
    reports.observe("p0", [report(nbytes=5 * MB)])
    assert reported(reports) == {}
    links = LinkEstimates(clock)
    assert links.table(reported(reports)).estimate("p0", "d0") == (None, LinkSource.NONE)
    reports.observe("p0", [report(nbytes=6 * MB, gbps=0.8)])  # bytes moved: a new sample
    assert reported(reports)["p0", "d0"].bytes_per_s == pytest.approx(100 * MB)


def test_a_link_no_longer_listed_or_of_a_worker_unheard_is_forgotten() -> None:
    clock = Clock()
    reports = LinkReports(clock)
    reports.observe("p0", [report()])
    reports.observe("p1", [report()])
    reports.observe("p0", [])  # its connection to the peer closed
    assert set(reports.fits()) == {("p1", "10.0.0.9:7000")}
    clock.now += MEMORY_S + 1  # p1 not heard since
    assert reports.fits() == {}


def test_no_rate_or_a_malformed_entry_is_no_estimate() -> None:
    reports = LinkReports(Clock())
    reports.observe("p0", [report(gbps=None), {"peer": 7}, "x",
                           report(peer="10.0.0.8:7000", gbps=float("inf")),
                           report(peer="10.0.0.7:7000", rtt_ms=None) | {"app_limited": "no"}])
    reports.observe("p1", {"peer": "10.0.0.9:7000"})
    assert reports.fits() == {}
    reports.observe("p2", [report(rtt_ms=None) | {"source": "transfers"}])  # NIXL: no RTT
    assert reports.fits()["p2", "10.0.0.9:7000"].fixed_s == 0.0
