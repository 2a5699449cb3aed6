"""`bench compare --repeats`: the round-by-round ratios against hand-computed values, where a
ratio of medians taken separately would say otherwise; rounds without a value; and the lines
the table gains (none for one round)."""

from __future__ import annotations

import pytest

from pdserve.bench.compare import combine_repeats, format_table
from pdserve.bench.paired_rounds import paired_lines, round_ratios


def _runs(ttfts: list[float | None]) -> list[dict]:
    return [{"median_ttft_ms": t, "request_goodput": 0.4, "completed": 10} for t in ttfts]


def test_each_round_is_compared_with_the_same_round_of_the_first() -> None:
    # the machine slowed in rounds 1-2: B is 0.8x A in every round but the third
    a, b = _runs([1000.0, 1000.0, 400.0]), _runs([800.0, 800.0, 500.0])
    assert round_ratios(b, a, "median_ttft_ms") == [0.8, 0.8, 1.25]
    lines = paired_lines({"a": combine_repeats(a), "b": combine_repeats(b)})
    assert "  b median_ttft_ms: 0.80x (0.80, 0.80, 1.25)" in lines
    assert "  b request_goodput: 1.00x (1.00, 1.00, 1.00)" in lines
    # the medians taken apart say 500 / 1000 = 0.5 here; the rounds say 0.8
    a, b = _runs([400.0, 1000.0, 1000.0]), _runs([500.0, 500.0, 800.0])
    assert combine_repeats(b)["median_ttft_ms"] / combine_repeats(a)["median_ttft_ms"] == 0.5
    assert paired_lines({"a": combine_repeats(a), "b": combine_repeats(b)})[1] == \
        "  b median_ttft_ms: 0.80x (1.25, 0.50, 0.80)"


def test_a_round_without_a_number_or_with_a_zero_base_gives_no_ratio() -> None:
    a = _runs([1000.0, 0.0, 500.0, 400.0])
    b = _runs([900.0, 300.0, None, float("nan")])
    assert round_ratios(b, a, "median_ttft_ms") == [0.9]
    assert round_ratios(b, a, "absent") == []


def test_rounds_of_different_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="3 rounds against 2: not paired"):
        round_ratios(_runs([1.0, 2.0, 3.0]), _runs([1.0, 2.0]), "median_ttft_ms")


def test_one_round_or_one_configuration_adds_no_lines() -> None:
    one = {"a": _runs([1000.0])[0], "b": _runs([800.0])[0]}
    assert paired_lines(one) == []
    assert "round by round" not in format_table(one)
    assert paired_lines({"a": combine_repeats(_runs([1.0, 2.0]))}) == []
    two = {"a": combine_repeats(_runs([1000.0, 900.0])),
           "b": combine_repeats(_runs([800.0, 900.0]))}
    assert "  b median_ttft_ms: 0.90x (0.80, 1.00)" in format_table(two, repeats=2)
