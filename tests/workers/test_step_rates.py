"""The speeds a worker reports for the router's split decision, from its recent steps."""

from __future__ import annotations

import pytest

from pdserve.workers.step_rates import StepRates, step_rates
from pdserve.workers.step_trace import Step, StepTrace


def _step(start: float, seconds: float, prefill: int, decode: int) -> Step:
    return Step(start, start + seconds, prefill, decode, max(decode, 1), 0, 0)


def test_nothing_measured_reports_none() -> None:
    assert step_rates([]) == StepRates(None, None)
    assert StepRates().to_json() == {"prefill_tokens_per_s": None, "decode_step_s": None}


def test_prefill_rate_is_tokens_over_seconds_and_decode_the_median_step() -> None:
    steps = [_step(0, 0.5, 400, 0), _step(1, 0.5, 200, 4),  # 600 tokens in 1 s
             _step(2, 0.02, 0, 4), _step(3, 0.03, 0, 4), _step(4, 0.9, 0, 4)]
    rates = step_rates(reversed(steps))
    assert rates.prefill_tokens_per_s == pytest.approx(600.0)
    assert rates.decode_step_s == pytest.approx(0.03)  # one slow step moves nothing


def test_only_the_newest_window_counts() -> None:
    old = [_step(t, 1.0, 100, 0) for t in range(10)]  # 100 tokens/s long ago
    new = [_step(10 + t, 0.1, 100, 0) for t in range(4)]  # 1000 tokens/s now
    rates = step_rates(reversed(old + new), window=4)
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0)


def test_the_trace_gives_its_newest_steps_first() -> None:
    trace = StepTrace(capacity=8)
    for t in range(10):
        trace.record(_step(t, 0.1, 0, 1))
    assert [s.start for s in trace.newest_first(3)] == [9, 8, 7]
    assert len(trace.newest_first(100)) == 8
