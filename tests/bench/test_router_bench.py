"""`pdserve bench router` arithmetic: the median difference of request pairs (request i of
each path) in each run, then the median over runs."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench import router_bench
from pdserve.bench.router_bench import (
    WAVES,
    RouterBenchSettings,
    RunStats,
    _bodies,
    _in_process_added,
    _paired,
    _row,
    run_size,
)


def stats(e2e: list[float], ttft: list[float]) -> RunStats:
    return RunStats(e2e, ttft, 16 * len(e2e))


def test_one_stream_adds_the_median_of_pair_differences() -> None:
    # the engine drifts from 100 ms to 300 ms per request; the router adds 1 ms to each
    direct = stats([0.100, 0.200, 0.300], [0.010, 0.020, 0.030])
    router = stats([0.101, 0.201, 0.301], [0.0115, 0.0215, 0.0315])
    row = _row(1, {"direct": [direct], "router": [router]}, [2e-4], [0.05], [4e-4])
    assert row["added_e2e_p50_ms"] == pytest.approx(1.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(1.5)
    assert row["router_cpu_per_token_over_step"] == pytest.approx(2e-4 / 0.05)
    assert row["in_process_added_mean_ms"] == pytest.approx(0.4)


def test_auth_cost_is_the_checks_per_request_against_the_routers_cpu_per_request() -> None:
    direct = stats([0.100], [0.010])
    row = _row(64, {"direct": [direct], "router": [direct]}, [100e-6, 120e-6, 110e-6],
               [0.05] * 3, [0.0] * 3, ([3e-6, 2e-6, 9e-6], [16.0, 15.0, 17.0]))
    assert row["auth_check_us_per_request"] == pytest.approx(3)
    assert row["auth_cost_of_router_cpu"] == pytest.approx(3e-6 / (110e-6 * 16))


def test_one_stream_pairs_alternate_which_path_goes_first(monkeypatch) -> None:
    sent: list[tuple[str, dict]] = []

    async def one(session, url: str, body: dict, s: RunStats, i: int) -> None:
        sent.append((url, body))
        s.e2e[i], s.ttft[i] = len(sent) / 10, len(sent) / 100

    monkeypatch.setattr(router_bench, "_one", one)
    settings = RouterBenchSettings(requests=4)
    direct, router = asyncio.run(_paired("D", "R", "m", settings))
    assert [url for url, _ in sent] == ["D", "R", "R", "D", "D", "R", "R", "D"]
    bodies = _bodies("m", settings, 4)  # pair i: request i of the run, on each path
    assert [body for _, body in sent] == [b for b in bodies for _ in range(2)]
    assert direct.e2e == pytest.approx([0.1, 0.4, 0.5, 0.8])
    assert router.e2e == pytest.approx([0.2, 0.3, 0.6, 0.7])


def test_many_streams_add_the_median_pair_difference_of_each_run() -> None:
    # run 1 is slow on both paths (the engine drifted), run 2 fast. Run 1's pairs differ by
    # 1, 9 and 5 ms: their median is 5 (the medians' difference, of other requests, is 9)
    direct = [stats([0.300, 0.100, 0.200], [0.03, 0.01, 0.02]),
              stats([0.150, 0.050, 0.100], [0.01, 0.02, 0.03])]
    router = [stats([0.301, 0.109, 0.205], [0.032, 0.012, 0.022]),
              stats([0.155, 0.055, 0.105], [0.020, 0.030, 0.040])]
    row = _row(64, {"direct": direct, "router": router}, [1e-4, 3e-4], [0.05, 0.07],
               [3e-4, 9e-4])
    assert row["added_e2e_p50_ms"] == pytest.approx(5.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(6.0)  # median of +2 and +10 ms
    assert row["decode_step_ms"] == pytest.approx(60.0)
    assert row["router_cpu_us_per_token"] == pytest.approx(200.0)
    assert row["in_process_added_mean_ms"] == pytest.approx(0.6)


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
