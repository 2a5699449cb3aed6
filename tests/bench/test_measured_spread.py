"""A figure measured more than once is noise when two of its measurements, earlier and later,
moved by more than its tolerance: the rule `bench simulator` applies to a repeated run's rounds
and `bench simulator-repeat` to two runs."""

from __future__ import annotations

import pytest

from pdserve.bench.measured_spread import apart, change, rounds


def test_a_change_is_taken_from_the_earlier_measurement():
    assert change(100.0, 70.0) == pytest.approx(-0.30)
    assert change(70.0, 100.0) == pytest.approx(0.4286, abs=1e-4)


@pytest.mark.parametrize(("values", "tolerance", "expected"), [
    ([494.0, 2853.0], 0.35, True),  # a P99 ITL on the edge of a run's stalls: 5.8x
    ([100.0, 70.0], 0.25, True),
    ([100.0, 80.0], 0.25, False),
    ([80.0, 100.0], 0.25, False),  # exactly the tolerance is within it
    ([100.0, 110.0, 128.0], 0.25, True),  # the first and the last
    ([0.0, 0.2], 0.25, False),  # no change can be taken from 0
    ([5.0], 0.25, False),
])
def test_values_are_apart_when_some_pair_moved_by_more_than_the_tolerance(values, tolerance,
                                                                          expected):
    assert apart(values, tolerance) is expected


def test_rounds_are_read_in_run_order_and_only_from_repeated_runs():
    result = {"p99_itl_ms": 1673.0, "repeats": [{"p99_itl_ms": 2853.0}, {"p99_itl_ms": 494}]}
    assert rounds(result, "p99_itl_ms") == [2853.0, 494.0]
    assert rounds({"p99_itl_ms": 500.0}, "p99_itl_ms") == []
    assert rounds({"repeats": [{"p99_itl_ms": 1.0}]}, "p99_itl_ms") == []
    assert rounds({"repeats": [{"p99_itl_ms": 1.0}, {"p99_itl_ms": None}]}, "p99_itl_ms") == []
