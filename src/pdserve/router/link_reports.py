"""The workers' own reports of their KV links (`links` in their signed /health,
`transfer/link_report.py`), kept as the router trusts them for a link's bandwidth: what the
split decision counts for a (prefill, decode) pair that has no hand-over of its own in memory
(`link_estimates.py`).

Rule, per link (the reporting worker's URL, the peer's KV endpoint host:port as the report
names it), from the reports the router's health checks read (one a second per worker):

- A report is a new sample of its link when the router sees the link for the first time (it
  cannot know how old the worker's numbers are; the worker lists only the links it holds now)
  or when its `bytes_sent` differs from the one seen before (the link moved bytes since, so
  the kernel's or the transport's numbers are newer). The same bytes again are the same old
  measurement: no new sample, however often they are read.
- A sample is trusted as a bandwidth measurement only if its `gbps` is a positive finite
  number and it is not `app_limited` (a tcp sender that had too little to send delivered
  below the link's rate, by any amount: such a rate only bounds the link from below). An
  untrusted sample replaces nothing.
- The link's estimate is its latest trusted sample while the router saw that sample at most
  MEMORY_S ago (the hand-over estimates' memory: a report is as old as the last bytes it
  counts, so a link unused for that long is unknown again, and probed like a pair never
  measured):

      seconds(bytes) = rtt_s + bytes / (gbps x 1e9 / 8)

  rtt_s: the sample's smoothed round-trip time (`rtt_ms` / 1e3), the fixed term (a
  hand-over's messages cost about one round trip beyond their bytes); 0 where the transport
  measures none (NIXL).
- A link the worker stops listing (its connection closed, the worker restarted) is forgotten
  at its next report; every link of a worker not heard for MEMORY_S, too.

A report tells what the link does for bytes, not what a split adds to a request (a hand-over
that overlaps the prefill's compute adds less; one that waits for the decode worker's step
adds more), so it stands in only where the pair's own hand-overs are missing.

Lifetime: one per router (`PathChoice`), fed by the worker pool's health checks and read by
the split decision, all on the router's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.numbers import is_finite_number
from pdserve.router.link_estimates import MEMORY_S, LinkFit
from pdserve.transfer.link_report import LinkReport

Link = tuple[str, str]  # (reporting worker URL, peer KV endpoint host:port)


@dataclass
class _Seen:
    bytes_sent: int  # as last reported
    seen_at: float  # when a health check last listed the link
    trusted: LinkFit | None = None  # the latest trusted sample
    trusted_at: float = 0.0  # when the router saw it first


class LinkReports:
    """Every worker's reported links, and their trusted estimates (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._links: dict[Link, _Seen] = {}

    def observe(self, worker: str, links: object) -> None:
        """One health answer's `links` of the worker at URL `worker` (entries that are not
        valid reports are skipped)."""
        now = self._clock()
        reports = parse_reports(links)
        for gone in [k for k in self._links if k[0] == worker and k[1] not in reports]:
            del self._links[gone]
        for peer, report in reports.items():
            seen = self._links.get((worker, peer))
            new = seen is None or seen.bytes_sent != report.bytes_sent
            if seen is None:
                seen = self._links[worker, peer] = _Seen(report.bytes_sent, now)
            seen.bytes_sent, seen.seen_at = report.bytes_sent, now
            fit = trusted_fit(report)
            if new and fit is not None:
                seen.trusted, seen.trusted_at = fit, now

    def fits(self) -> dict[Link, LinkFit]:
        """The links with a trusted sample in memory, and their estimates."""
        now = self._clock()
        self._links = {k: s for k, s in self._links.items() if now - s.seen_at <= MEMORY_S}
        return {k: s.trusted for k, s in self._links.items()
                if s.trusted is not None and now - s.trusted_at <= MEMORY_S}


def trusted_fit(report: LinkReport) -> LinkFit | None:
    """The report's estimate of its link, or None where its rate is no measurement of it."""
    if report.app_limited or not _positive(report.gbps):
        return None
    rtt_ms = report.rtt_ms if _positive(report.rtt_ms) else 0.0
    return LinkFit(rtt_ms / 1e3, report.gbps * 1e9 / 8, 0)


def parse_reports(links: object) -> dict[str, LinkReport]:
    """A health answer's `links` by peer; of several for one peer, the one with the most
    bytes (the older connection to an address whose worker restarted has fewer)."""
    out: dict[str, LinkReport] = {}
    for entry in links if isinstance(links, list) else []:
        report = _report(entry)
        if report is not None and (report.peer not in out
                                   or report.bytes_sent > out[report.peer].bytes_sent):
            out[report.peer] = report
    return out


def _report(entry: object) -> LinkReport | None:
    if not isinstance(entry, dict):
        return None
    peer, source, nbytes = entry.get("peer"), entry.get("source"), entry.get("bytes_sent")
    app_limited = entry.get("app_limited", False)
    if not (isinstance(peer, str) and isinstance(source, str) and isinstance(nbytes, int)
            and not isinstance(nbytes, bool) and isinstance(app_limited, bool)):
        return None
    gbps, rtt_ms = entry.get("gbps"), entry.get("rtt_ms")
    return LinkReport(peer, source, float(gbps) if is_finite_number(gbps) else None, nbytes,
                      float(rtt_ms) if is_finite_number(rtt_ms) else None, app_limited=app_limited)


def _positive(value: float | None) -> bool:
    return value is not None and is_finite_number(value) and value > 0
