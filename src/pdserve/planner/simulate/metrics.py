"""Serving metrics of simulated requests, under the names vLLM `bench serve` prints.

Definitions (vLLM benchmarks/serve.py, `calculate_metrics`):
- TTFT: first token time - arrival. E2EL: last token time - arrival.
- TPOT per request: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one
  output token.
- ITL: every gap between consecutive tokens of a request, over all requests (token 0 -> 1
  included, so a disaggregated request's KV transfer shows up here, not in TTFT).
- percentiles: linear interpolation between order statistics (numpy.percentile's default,
  Hyndman and Fan type 7); median = P50.
- throughput: completed requests (and their output tokens) / duration, where duration runs
  from the first arrival to the last end (a finish or a refusal).
- goodput: completed requests meeting every SLO given (TTFT <= slo_ttft_ms, TPOT <=
  slo_tpot_ms; a one-token request has no TPOT and meets that SLO) / duration.
- failed: requests the router's admission refused (admission.py): no token, so, as bench serve
  does with failed requests, they are left out of every latency statistic, the token totals,
  throughput and goodput, and counted only here and in the duration.
ITLs are stored run-length encoded (`ItlSamples`): a decode step of B requests adds one value
B times, so a long trace costs one entry per step, not one per token. Empty metrics are None
(vLLM prints 0).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request's life in the simulator; times in seconds from trace start.

    `prefilled` counts prompt tokens computed so far (chunked prefill); `token_times` holds every
    token's time when the run traces tokens, else stays None. A request ends either finished
    (`finish_s` set) or refused by admission (`refused` the HTTP status, 429 or 503, and
    `refused_s` its time; it then has no token), never both.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    prefilled: int = 0
    token_times: list[float] | None = None
    refused: int | None = None
    refused_s: float | None = None
    # a split layout's path for it (routing.py): True prefilled on its decode worker, False
    # split; None until routed, and in the other layouts
    local: bool | None = None

    @property
    def ok(self) -> bool:
        """Not refused (a finished request, or one still running)."""
        return self.refused is None

    @property
    def end_s(self) -> float:
        """When it finished or was refused; ValueError while it runs."""
        return _done(self, self.finish_s if self.ok else self.refused_s)

    @property
    def ttft_s(self) -> float:
        return _done(self, self.first_token_s) - self.arrival_s

    @property
    def e2el_s(self) -> float:
        return _done(self, self.finish_s) - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens == 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def _done(record: RequestRecord, value: float | None) -> float:
    if value is None:
        raise ValueError(f"request {record.index} has not finished")
    return value


@dataclass
class ItlSamples:
    """Inter-token latencies as (value, count) runs; `add` appends, order does not matter."""

    values: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, value: float, count: int = 1) -> None:
        self.values.append(value)
        self.counts.append(count)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def share_above(self, value_ms: float) -> float | None:
        """The share of the ITLs longer than `value_ms` (None: no ITL)."""
        total = self.total
        if total == 0:
            return None
        above = sum(c for v, c in zip(self.values, self.counts, strict=True)
                    if v * 1e3 > value_ms)
        return above / total


@dataclass(frozen=True)
class Stats:
    """mean, median, P90 and P99 of one metric, in milliseconds."""

    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float


def _weighted_stats(values: Sequence[float], counts: Sequence[int]) -> Stats | None:
    """Stats of a multiset given as values with repeat counts (type-7 percentiles)."""
    n = sum(counts)
    if n == 0:
        return None
    pairs = sorted(zip(values, counts, strict=True))
    ordered = [v for v, _ in pairs]
    ends = list(itertools.accumulate(c for _, c in pairs))  # items in runs 0..i

    def at(rank: int) -> float:  # the rank-th smallest item, 0-based
        return ordered[bisect.bisect_right(ends, rank)]

    def percentile(q: float) -> float:
        h = (n - 1) * q / 100
        lo = math.floor(h)
        return at(lo) + (h - lo) * (at(min(lo + 1, n - 1)) - at(lo))

    mean = math.fsum(v * c for v, c in pairs) / n
    p50, p90, p99 = (percentile(q) * 1e3 for q in PERCENTILES)
    return Stats(mean * 1e3, p50, p90, p99)


def stats(values: Sequence[float]) -> Stats | None:
    """Stats of plain samples in seconds (None when empty)."""
    return _weighted_stats(values, [1] * len(values))


@dataclass(frozen=True)
class Slo:
    """Latency targets in ms; None: no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"slo_{name} (--slo-{name.replace('_', '-')}) must be a "
                                 f"positive number of ms, got {value!r}")

    def met(self, record: RequestRecord) -> bool:
        if self.ttft_ms is not None and record.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Summary:
    """Every reported number of one simulated configuration."""

    completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    good_requests: int
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2el: Stats | None
    failed: int = 0  # refused by admission

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_goodput(self) -> float:
        return self.good_requests / self.duration_s if self.duration_s > 0 else 0.0


def summarize(records: Sequence[RequestRecord], itl: ItlSamples, slo: Slo) -> Summary:
    """The Summary of ended `records` (finished or refused); ValueError if any runs still.
    Refused ones count in `failed` and the duration only (module docstring)."""
    if not records:
        raise ValueError("no requests to summarize: the trace is empty")
    start = min(r.arrival_s for r in records)
    end = max(r.end_s for r in records)
    ok = [r for r in records if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    return Summary(
        completed=len(ok), duration_s=end - start,
        total_input_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=sum(r.output_tokens for r in ok),
        good_requests=sum(1 for r in ok if slo.met(r)),
        ttft=stats([r.ttft_s for r in ok]), tpot=stats(tpots),
        itl=_weighted_stats(itl.values, itl.counts), e2el=stats([r.e2el_s for r in ok]),
        failed=len(records) - len(ok))


def summary_to_dict(summary: Summary) -> dict[str, Any]:
    """vLLM `bench serve` keys: completed, request_throughput, mean_ttft_ms, p99_itl_ms, ..."""
    out: dict[str, Any] = {
        "completed": summary.completed, "failed": summary.failed,
        "duration": summary.duration_s,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "request_goodput": summary.request_goodput, "good_requests": summary.good_requests,
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        s: Stats | None = getattr(summary, metric)
        for stat in ("mean", "median", "p90", "p99"):
            out[f"{stat}_{metric}_ms"] = None if s is None else getattr(s, f"{stat}_ms")
    return out
