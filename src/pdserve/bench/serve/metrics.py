"""vLLM `bench serve` metrics from client-side request records: pure functions, no clock.

Definitions (those of vLLM's `vllm/benchmarks/serve.py`, measured on the client):
- TTFT = arrival of the first text event - send.
- ITL = every gap between consecutive text events of a request (a request with k text events
  gives k - 1 gaps); all requests' gaps are pooled.
- E2E latency (`e2el`) = end of the stream ([DONE]) - send. vLLM takes its last event instead;
  with include_usage the usage event and [DONE] follow the last token at once.
- TPOT of a request = (E2E - TTFT) / (output_tokens - 1), only for requests with more than one
  output token.
- Latency statistics cover successful requests only: mean, median, std (population, ddof=0,
  as numpy's default), P90 and P99 (`percentile`), in milliseconds; None when there is no
  value (e.g. TPOT when every output is one token).
- duration = last end - first send over all requests, failed ones included.
- request_throughput = completed / duration; output_throughput = total_output_tokens /
  duration; total_token_throughput = (total_input_tokens + total_output_tokens) / duration;
  token totals count successful requests only (as vLLM); 0 when duration is 0.
- request_goodput = (successful requests meeting every given SLO) / duration, where meeting
  means TTFT <= slo_ttft_ms, TPOT <= slo_tpot_ms (TPOT counts as 0 for a one-token output,
  as vLLM), E2E <= slo_e2e_ms (bounds included); None when no SLO is given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from pdserve.bench.serve.client import RequestRecord

MS_PER_S = 1000.0
PERCENTILES = (90, 99)
MAX_ERRORS = 10


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None = no bound on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in self.settings().items():
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number of milliseconds >= 0, got {value}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in self.settings().values())

    def settings(self) -> dict[str, float | None]:
        return {"slo_ttft_ms": self.ttft_ms, "slo_tpot_ms": self.tpot_ms,
                "slo_e2e_ms": self.e2e_ms}


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) by linear interpolation between order statistics,
    numpy's default method ("linear", Hyndman & Fan type 7), which vLLM uses: with v sorted
    ascending and n values, rank = p / 100 * (n - 1), lo = floor(rank), and the result is
    v[lo] + (rank - lo) * (v[lo + 1] - v[lo]) (just v[lo] when lo = n - 1)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile needs 0 <= p <= 100, got {p}")
    v = sorted(values)
    rank = p / 100 * (len(v) - 1)
    lo = math.floor(rank)
    if lo == len(v) - 1:
        return v[lo]
    return v[lo] + (rank - lo) * (v[lo + 1] - v[lo])


def distribution_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """mean_/median_/std_/p90_/p99_{name}_ms of values in seconds; all None when empty."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    mean = math.fsum(values_s) / len(values_s)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in values_s) / len(values_s))
    stats = [mean, percentile(values_s, 50), std, *(percentile(values_s, p) for p in PERCENTILES)]
    return {f"{k}_{name}_ms": MS_PER_S * s for k, s in zip(keys, stats, strict=True)}


def ttft_s(r: RequestRecord) -> float | None:
    """First text event - send; None without any text event."""
    return r.token_times_s[0] - r.send_s if r.token_times_s else None


def itl_s(r: RequestRecord) -> list[float]:
    """Gaps between consecutive text events."""
    return [b - a for a, b in pairwise(r.token_times_s)]


def e2e_s(r: RequestRecord) -> float:
    """End of the stream - send."""
    return r.end_s - r.send_s


def tpot_s(r: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output_tokens - 1); None for one output token or none."""
    ttft = ttft_s(r)
    if ttft is None or r.output_tokens <= 1:
        return None
    return (e2e_s(r) - ttft) / (r.output_tokens - 1)


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    """A successful request within every given bound (bounds included)."""
    return r.ok and within_slo(ttft_s(r), tpot_s(r), e2e_s(r), slo)


def within_slo(ttft: float | None, tpot: float | None, e2e: float | None, slo: Slo) -> bool:
    """Times in seconds within every given bound (bounds included); a TPOT of None (one
    output token) counts 0, a missing TTFT or E2E meets no bound on it."""
    checks = ((ttft, slo.ttft_ms), (tpot or 0.0, slo.tpot_ms), (e2e, slo.e2e_ms))
    return all(bound is None or (value is not None and MS_PER_S * value <= bound)
               for value, bound in checks)


def duration_s(records: Sequence[RequestRecord]) -> float:
    """Last end - first send over all records."""
    return max(r.end_s for r in records) - min(r.send_s for r in records)


def _latencies(ok: Sequence[RequestRecord]) -> dict[str, list[float]]:
    return {
        "ttft": [t for r in ok if (t := ttft_s(r)) is not None],
        "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
        "itl": [gap for r in ok for gap in itl_s(r)],
        "e2el": [e2e_s(r) for r in ok],
    }


def compute_metrics(records: Sequence[RequestRecord], slo: Slo | None = None) -> dict[str, Any]:
    """Every metric of the module docstring, under vLLM's JSON keys, plus `failed` and
    `errors` (the first MAX_ERRORS error messages, in request order)."""
    if not records:
        raise ValueError("no requests to measure")
    ok = [r for r in records if r.ok]
    duration = duration_s(records)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    slo = slo or Slo()
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(sum(meets_slo(r, slo) for r in ok)) if slo.given else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    for name, values in _latencies(ok).items():
        out |= distribution_ms(name, values)
    out["errors"] = [r.error for r in records if r.error is not None][:MAX_ERRORS]
    return out


def request_json(r: RequestRecord, t0: float) -> dict[str, Any]:
    """One request for CDF and timeline pictures; times in seconds, `start_s` from t0."""
    return {"start_s": r.send_s - t0, "ttft_s": ttft_s(r), "itl_s": itl_s(r), "e2e_s": e2e_s(r),
            "tpot_s": tpot_s(r), "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens, "ok": r.ok, "error": r.error, "route": r.route}
