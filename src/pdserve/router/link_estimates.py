"""How long a KV hand-over takes on each link, learnt from the router's own split requests.

A link is a (prefill worker, decode worker) pair, named by the two workers' URLs (a worker that
registers again at another address is on another link). Each split request that moved its KV
is one sample of its pair: the bytes that moved (the KV of every prompt token, in whole
blocks: the decode worker reserves blocks for the whole prompt without its prefix cache and
the prefill worker sends them all, whatever either side had cached) and the seconds from the
prefill leg's token 0 to the decode leg's first event, as the router sees them. That is the
first-token delay the split adds beyond the prefill (with layer streaming, what of the
transfer did not overlap the prefill's compute, and what the decode worker did before it took
the KV, e.g. the rest of a step of a local prefill), which is what the split decision needs;
hosts behind different links get different estimates.

Model: seconds = fixed + bytes / bandwidth, a weighted least-squares line through the pair's
samples, when they span a range of sizes (the largest at least MIN_SPREAD times the smallest,
at least MIN_FIT samples) and the line is sane (it rises, it meets the axis at or above 0);
else fixed = 0 and bandwidth = sum of weighted bytes / sum of weighted seconds (large
hand-overs weigh most and a fixed cost is spread over them). The fixed term is what a small
hand-over costs whatever its bytes (the decode worker's next step, the round trips of the
transfer's messages and of the two legs' events); without it, small prompts make a fast link
look slow for large ones.

No bandwidth from small hand-overs: while every sample in memory is below MIN_RATE_BYTES, a
hand-over's seconds are mostly that fixed part, and read as bytes over seconds they would make
the link look slower for a long prompt than it is by up to the ratio of the two prompts'
sizes (hundreds of times: a short chat turn would keep every long prompt local). Such a
link's estimate is its samples' weighted mean seconds as a fixed cost, whatever the bytes,
with no bandwidth (the gauge reads 0): bounded by what the link was seen to do, and
optimistic for a long prompt as an unmeasured link is (no cost), so the split is tried and
its first hand-over of MIN_RATE_BYTES or more measures the bandwidth. A small hand-over that
slows still shows at once, in the fixed cost.

Forgetting, so that a link that changed is known by what it does now, in a bounded number of
hand-overs or seconds: a sample weighs half as much with every HALF_LIFE newer samples of its
pair (a burst of new hand-overs takes over, however close together), and is dropped after
SAMPLES newer ones or MEMORY_S seconds. Slow samples carry the most seconds, so a link that
slows shows from its first slow hand-over on, and one that speeds up as its slow samples fade
and leave (all gone after SAMPLES hand-overs or MEMORY_S). The time bound is what lets the
router come back to a link it stopped using: once the split decision routes around a slow
link, no new samples come from it, and after MEMORY_S it is unmeasured again, so one split
request probes it (a link still slow costs that one request a slow hand-over, once per
MEMORY_S).

Where a pair's estimate comes from (`LinkSource`), first that applies:
1. `handovers`: its own samples in memory, as above.
2. `report`: its prefill worker's own report of its link to the decode worker's KV endpoint,
   where the router trusts it (`link_reports.py`: a recent rate sample not limited by the
   sender), as seconds = rtt + bytes / reported rate.
3. `mean`: the mean of the times of every pair that has 1 or 2, for the same bytes.
4. `none`: no pair has either: no cost (which favours the split, as the fixed rule did).
A report does not bound a pair's own estimate either way: the two measure different things
(what a split adds to a request, with what of the transfer overlapped the prefill's compute
taken out and what the decode worker did before taking the KV put in, against what the link
does for bytes), and either can be the larger on a healthy link.

Lifetime: one `LinkEstimates` per router (`PathChoice`), used on its event loop only.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from pdserve.metrics import Gauge

log = logging.getLogger("pdserve.router")

SAMPLES = 16  # hand-overs a link remembers
# a sample weighs half as much after this many newer ones on its link: one hand-over jitters
# (a decode step in its way), a few are averaged
HALF_LIFE = 4
MEMORY_S = 30.0  # a sample older than this is forgotten: a link avoided is probed this often
MIN_FIT = 3  # samples a fixed term is fitted from, at least
MIN_SPREAD = 4.0  # the largest hand-over at least this many times the smallest, for the fit
# the smallest hand-over a bandwidth is read from: 512 KiB take 4 ms at 1 Gb/s, the order of a
# hand-over's fixed part (a decode step, a few round trips), so a larger one's seconds are at
# least in part its bytes' (read as a rate, within a small factor of the link's), and a
# smaller one's mostly the fixed part
MIN_RATE_BYTES = 512 * 1024

Pair = tuple[str, str]  # (prefill worker URL, decode worker URL)


class LinkSource(StrEnum):
    """Where a pair's estimate came from (module docstring); the label of
    `pdserve_router_split_link_source_total`."""

    HANDOVERS = "handovers"
    REPORT = "report"
    MEAN = "mean"
    NONE = "none"


@dataclass(frozen=True)
class LinkFit:
    """One link's hand-over time: seconds = fixed_s + bytes / bytes_per_s (fixed_s alone
    while no bandwidth is measured)."""

    fixed_s: float
    bytes_per_s: float | None  # None: only hand-overs below MIN_RATE_BYTES, no bandwidth
    samples: int  # the hand-overs it was fitted from; 0: a worker's report (link_reports.py)

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def __str__(self) -> str:
        origin = f"{self.samples} hand-overs" if self.samples else "worker report"
        rate = f"{self.bytes_per_s * 8 / 1e6:.1f} Mb/s" if self.bytes_per_s else \
            f"no bandwidth (all under {MIN_RATE_BYTES // 1024} KiB)"
        return f"{rate} + {self.fixed_s * 1e3:.1f} ms ({origin})"


class LinkEstimate:
    """One link's recent hand-overs and the line through them (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: deque[tuple[float, int, float]] = deque(maxlen=SAMPLES)

    def observe(self, nbytes: int, seconds: float) -> bool:
        """Adds one hand-over; False (nothing added) for nothing moved or a nonsense time."""
        if nbytes <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return False
        self._samples.append((self._clock(), nbytes, seconds))
        return True

    def fit(self) -> LinkFit | None:
        """The line through the samples in memory; None: none is."""
        now = self._clock()
        while self._samples and now - self._samples[0][0] > MEMORY_S:
            self._samples.popleft()
        n = len(self._samples)
        if not n:
            return None
        return _fit([(0.5 ** ((n - 1 - i) / HALF_LIFE), float(b), s)
                     for i, (_, b, s) in enumerate(self._samples)])


class LinkTable:
    """Every known link's estimate at one instant, and the fallback for the others. `fits`:
    from the pairs' own hand-overs; `reported`: from the workers' reports, for pairs (URLs)."""

    def __init__(self, fits: dict[Pair, LinkFit],
                 reported: dict[Pair, LinkFit] | None = None) -> None:
        self.fits = fits
        self.reported = reported or {}

    def estimate(self, prefill: str, decode: str) -> tuple[LinkFit | None, LinkSource]:
        """The pair's own estimate and its source; no fit for `mean` and `none`."""
        if (own := self.fits.get((prefill, decode))) is not None:
            return own, LinkSource.HANDOVERS
        if (reported := self.reported.get((prefill, decode))) is not None:
            return reported, LinkSource.REPORT
        return None, LinkSource.MEAN if self.fits or self.reported else LinkSource.NONE

    def seconds(self, prefill: str, decode: str, nbytes: int) -> float:
        """The hand-over time of `nbytes` from `prefill` to `decode` (URLs)."""
        fit, _ = self.estimate(prefill, decode)
        if fit is not None:
            return fit.seconds(nbytes)
        known = {**self.reported, **self.fits}
        if not known:
            return 0.0
        return sum(f.seconds(nbytes) for f in known.values()) / len(known)

    def describe(self, prefill: str, decode: str) -> str:
        """The pair's estimate and where it came from, for the log."""
        fit, source = self.estimate(prefill, decode)
        if fit is not None:
            return f"[{source.value}] {fit}"
        if source is LinkSource.MEAN:
            known = len(self.reported.keys() | self.fits.keys())
            return f"[{source.value}] not known: the mean of {known} known links"
        return f"[{source.value}] not known, nor any other: no cost"


class LinkEstimates:
    """One `LinkEstimate` per (prefill, decode) pair with a hand-over in memory."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._links: dict[Pair, LinkEstimate] = {}
        self._published: set[Pair] = set()

    def observe(self, prefill: str, decode: str, nbytes: int, seconds: float) -> None:
        """A split request's KV of `nbytes` from `prefill` to `decode` (URLs) took `seconds`."""
        link = self._links.setdefault((prefill, decode), LinkEstimate(self._clock))
        if link.observe(nbytes, seconds):
            log.debug("link %s -> %s: %d bytes in %.1f ms; now %s", prefill, decode, nbytes,
                      seconds * 1e3, link.fit())

    def table(self, reported: dict[Pair, LinkFit] | None = None) -> LinkTable:
        """The fits now, with the trusted reports of pairs (URLs) for the pairs without one;
        links with no sample in memory are left out, and dropped."""
        fits = {pair: fit for pair, link in self._links.items()
                if (fit := link.fit()) is not None}
        self._links = {pair: self._links[pair] for pair in fits}
        return LinkTable(fits, reported)

    def publish(self, bandwidth: Gauge, fixed: Gauge) -> None:
        """Each link's fit from its own hand-overs into the two gauges (labels prefill,
        decode; reports are not shown there); a link with nothing in memory any more reads 0
        in both, one with no bandwidth measured 0 in the bandwidth's."""
        fits = self.table().fits
        for prefill, decode in self._published - fits.keys():
            bandwidth.set(0.0, prefill=prefill, decode=decode)
            fixed.set(0.0, prefill=prefill, decode=decode)
        for (prefill, decode), fit in fits.items():
            bandwidth.set(fit.bytes_per_s or 0.0, prefill=prefill, decode=decode)
            fixed.set(fit.fixed_s, prefill=prefill, decode=decode)
        self._published |= fits.keys()


def _fit(samples: list[tuple[float, float, float]]) -> LinkFit:
    """Weighted (weight, bytes, seconds) samples -> the line, or the ratio, or a fixed cost
    alone when every sample is below MIN_RATE_BYTES (module docstring)."""
    total = sum(w for w, _, _ in samples)
    mean_b = sum(w * b for w, b, _ in samples) / total
    mean_s = sum(w * s for w, _, s in samples) / total
    sizes = [b for _, b, _ in samples]
    if max(sizes) < MIN_RATE_BYTES:
        return LinkFit(mean_s, None, len(samples))
    if len(samples) >= MIN_FIT and max(sizes) >= MIN_SPREAD * min(sizes):
        var_b = sum(w * (b - mean_b) ** 2 for w, b, _ in samples)
        cov = sum(w * (b - mean_b) * (s - mean_s) for w, b, s in samples)
        slope = cov / var_b
        fixed = mean_s - slope * mean_b
        if slope > 0 and fixed >= 0:
            return LinkFit(fixed, 1.0 / slope, len(samples))
    return LinkFit(0.0, mean_b / mean_s, len(samples))
