"""`pdserve bench router` arithmetic: paired differences at one stream, medians above."""

from __future__ import annotations

import pytest

from pdserve.bench.router_bench import (
    WAVES,
    RouterBenchSettings,
    RunStats,
    _bodies,
    _in_process_added,
    _row,
    run_size,
)


def stats(e2e: list[float], ttft: list[float]) -> RunStats:
    return RunStats(e2e, ttft, 16 * len(e2e), sum(e2e))


def test_one_stream_adds_the_median_of_pair_differences() -> None:
    # the engine drifts from 100 ms to 300 ms per request; the router adds 1 ms to each
    direct = stats([0.100, 0.200, 0.300], [0.010, 0.020, 0.030])
    router = stats([0.101, 0.201, 0.301], [0.0115, 0.0215, 0.0315])
    row = _row(1, {"direct": [direct], "router": [router]}, [2e-4],
               {"direct": [], "router": [0.05]}, [4e-4])
    assert row["added_e2e_p50_ms"] == pytest.approx(1.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(1.5)
    assert row["router_cpu_per_token_over_step"] == pytest.approx(2e-4 / 0.05)
    assert row["in_process_added_mean_ms"] == pytest.approx(0.4)


def test_many_streams_add_the_difference_of_medians() -> None:
    direct = stats([0.300, 0.100, 0.200], [0.03, 0.01, 0.02])
    router = stats([0.105, 0.205, 0.405], [0.012, 0.022, 0.032])
    row = _row(64, {"direct": [direct], "router": [router]}, [1e-4],
               {"direct": [0.06], "router": [0.05]}, [3e-4, 9e-4, 5e-4])
    assert row["added_e2e_p50_ms"] == pytest.approx(5.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(2.0)
    assert row["decode_step_ms"] == pytest.approx(50.0)
    assert row["direct_decode_step_ms"] == pytest.approx(60.0)
    assert row["in_process_added_mean_ms"] == pytest.approx(0.5)  # the median run


def test_in_process_added_is_router_mean_minus_worker_mean() -> None:
    # 10 requests: 3 s in the router, 2.99 s in the worker; the engine's time cancels
    before = ((1.0, 5.0), (7.0, 12.0))  # (router sum, count), (worker sum, count)
    after = ((4.0, 15.0), (9.99, 22.0))
    assert _in_process_added(before, after) == pytest.approx(0.001)


def test_requests_vary_the_same_way_on_both_paths() -> None:
    s = RouterBenchSettings(prompt_words=32, max_tokens=16)
    first, again = _bodies("m", s, 200), _bodies("m", s, 200)
    assert first == again  # seeded: request i is the same on both paths and in every run
    lengths = {b["max_tokens"] for b in first}
    assert min(lengths) >= 9 and max(lengths) <= 24 and len(lengths) > 8
    assert len({b["prompt"] for b in first}) > 8


def test_many_streams_run_several_waves() -> None:
    s = RouterBenchSettings(requests=64)
    assert run_size(s, 1) == 64
    assert run_size(s, 64) == WAVES * 64
