"""`pdserve bench router` arithmetic: paired differences at one stream, medians above."""

from __future__ import annotations

import pytest

from pdserve.bench.router_bench import RunStats, _row


def stats(e2e: list[float], ttft: list[float]) -> RunStats:
    return RunStats(e2e, ttft, 16 * len(e2e), sum(e2e))


def test_one_stream_adds_the_median_of_pair_differences() -> None:
    # the engine drifts from 100 ms to 300 ms per request; the router adds 1 ms to each
    direct = stats([0.100, 0.200, 0.300], [0.010, 0.020, 0.030])
    router = stats([0.101, 0.201, 0.301], [0.0115, 0.0215, 0.0315])
    row = _row(1, {"direct": [direct], "router": [router]}, [2e-4], [0.05])
    assert row["added_e2e_p50_ms"] == pytest.approx(1.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(1.5)
    assert row["router_cpu_per_token_over_step"] == pytest.approx(2e-4 / 0.05)


def test_many_streams_add_the_difference_of_medians() -> None:
    direct = stats([0.300, 0.100, 0.200], [0.03, 0.01, 0.02])
    router = stats([0.105, 0.205, 0.405], [0.012, 0.022, 0.032])
    row = _row(64, {"direct": [direct], "router": [router]}, [1e-4], [0.05])
    assert row["added_e2e_p50_ms"] == pytest.approx(5.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(2.0)
