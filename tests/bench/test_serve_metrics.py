"""`pdserve bench serve` metrics against a hand-computed trace.

Times are multiples of 1/16 s, exact in binary, so SLO bounds can include or exclude a
request exactly. The trace (seconds):

  R1 ok      send 0.0   text events 0.125 0.375 0.75           end 0.875  3 tokens, prompt 10
  R2 ok      send 0.5   text events 1.0 1.125 1.25 1.375 1.5   end 1.5    5 tokens, prompt 20
  R3 ok      send 1.0   text events 1.25                       end 1.25   1 token,  prompt 30
  R4 failed  send 1.25  text events 1.5  (then an error event) end 2.5    1 token,  prompt 40
  R5 failed  send 0.25  (HTTP 400)                             end 0.3125 0 tokens, prompt 50

  TTFT (ms): 125, 500, 250       ITL (ms): 250 375 | 125 125 125 125 | -
  TPOT (ms): (875-125)/2 = 375, (1000-500)/4 = 125, R3 has none
  E2E (ms): 875, 1000, 250       duration: 2.5 - 0.0 = 2.5 s (R4's end counts)
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pdserve.bench.serve.client import RequestRecord
from pdserve.bench.serve.metrics import (
    Slo,
    compute_metrics,
    distribution_ms,
    e2e_s,
    itl_s,
    percentile,
    request_json,
    tpot_s,
    ttft_s,
)


def _rec(send: float, times: tuple[float, ...], end: float, tokens: int, prompt: int,
         error: str | None = None) -> RequestRecord:
    return RequestRecord(prompt_tokens=prompt, max_tokens=8, send_s=send, token_times_s=times,
                         end_s=end, output_tokens=tokens, error=error)


R1 = _rec(0.0, (0.125, 0.375, 0.75), 0.875, 3, 10)
R2 = _rec(0.5, (1.0, 1.125, 1.25, 1.375, 1.5), 1.5, 5, 20)
R3 = _rec(1.0, (1.25,), 1.25, 1, 30)
R4 = _rec(1.25, (1.5,), 2.5, 1, 40, error="error event: worker died")
R5 = _rec(0.25, (), 0.3125, 0, 50, error="HTTP 400: prompt is too long")
TRACE = [R1, R2, R3, R4, R5]


def test_per_request_definitions():
    assert [ttft_s(r) for r in (R1, R2, R3)] == [0.125, 0.5, 0.25]
    assert itl_s(R1) == [0.25, 0.375]
    assert itl_s(R2) == [0.125] * 4
    assert itl_s(R3) == []
    assert [e2e_s(r) for r in (R1, R2, R3)] == [0.875, 1.0, 0.25]
    assert tpot_s(R1) == 0.375 and tpot_s(R2) == 0.125
    assert tpot_s(R3) is None and ttft_s(R5) is None and tpot_s(R5) is None


def test_counts_totals_and_throughput():
    m = compute_metrics(TRACE)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert m["duration"] == 2.5
    assert m["total_input_tokens"] == 60  # successful requests only
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(3 / 2.5)
    assert m["output_throughput"] == pytest.approx(9 / 2.5)
    assert m["total_token_throughput"] == pytest.approx(69 / 2.5)
    assert m["request_goodput"] is None  # no SLO given
    assert m["errors"] == ["error event: worker died", "HTTP 400: prompt is too long"]


def test_latency_statistics_exclude_failed_requests():
    m = compute_metrics(TRACE)
    expected = {
        # sorted TTFT 125 250 500: P90 rank 0.9 * 2 = 1.8 -> 250 + 0.8 * 250
        "ttft": (875 / 3, 250, 450, 495),
        # sorted ITL 125 x4, 250, 375: median rank 2.5 -> 125; P90 rank 4.5 -> 312.5
        "itl": (187.5, 125, 312.5, 368.75),
        "tpot": (250, 250, 350, 372.5),  # 125, 375: P90 rank 0.9 -> 125 + 0.9 * 250
        "e2el": (2125 / 3, 875, 975, 997.5),  # 250 875 1000: P90 -> 875 + 0.8 * 125
    }
    for name, (mean, median, p90, p99) in expected.items():
        got = (m[f"mean_{name}_ms"], m[f"median_{name}_ms"], m[f"p90_{name}_ms"],
               m[f"p99_{name}_ms"])
        assert got == pytest.approx((mean, median, p90, p99)), name
    # population std (ddof 0): TTFT deviations from 875/3 are -500/3, 625/3, -125/3
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((500**2 + 625**2 + 125**2) / 27))
    assert m["std_tpot_ms"] == pytest.approx(125)


@pytest.mark.parametrize(("slo", "good"), [
    (Slo(ttft_ms=250), 2),  # R1, R3 (exactly 250); R2 500 out
    (Slo(ttft_ms=249), 1),  # R3 out now
    (Slo(tpot_ms=125), 2),  # R2 exactly 125, R3 counts as 0; R1 375 out
    (Slo(tpot_ms=124), 1),  # only R3
    (Slo(ttft_ms=250, tpot_ms=125), 1),  # every bound at once: R3 only
    (Slo(e2e_ms=875), 2),  # R1 exactly, R3
    (Slo(e2e_ms=874), 1),
    (Slo(ttft_ms=1e6, tpot_ms=1e6, e2e_ms=1e6), 3),  # R4 met them too, but it failed
])
def test_goodput_bounds_are_inclusive(slo, good):
    assert compute_metrics(TRACE, slo)["request_goodput"] == pytest.approx(good / 2.5)


def test_no_values_give_none_and_no_requests_refused():
    m = compute_metrics([R3, R5])
    assert m["mean_tpot_ms"] is None and m["p99_itl_ms"] is None
    assert m["median_ttft_ms"] == 250
    assert distribution_ms("x", []) == {"mean_x_ms": None, "median_x_ms": None,
                                        "std_x_ms": None, "p90_x_ms": None, "p99_x_ms": None}
    with pytest.raises(ValueError):
        compute_metrics([])


def test_percentile_is_numpy_linear_interpolation():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # rank 1.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    rng = random.Random(7)
    for n in (2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_slo_validation_and_request_json():
    with pytest.raises(ValueError):
        Slo(ttft_ms=-1)
    with pytest.raises(ValueError):
        Slo(tpot_ms=math.nan)
    assert not Slo().given and Slo(e2e_ms=0).given
    row = request_json(R2, t0=0.25)
    assert row == {"start_s": 0.25, "ttft_s": 0.5, "itl_s": [0.125] * 4, "e2e_s": 1.0,
                   "tpot_s": 0.125, "output_tokens": 5, "prompt_tokens": 20, "ok": True,
                   "error": None, "route": None}
    assert request_json(R5, 0.0)["ok"] is False
