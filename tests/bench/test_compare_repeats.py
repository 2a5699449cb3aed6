"""`pdserve bench compare --repeats`: medians over runs against hand-computed values, the
combined JSON object, the interleaved run order, and the refusal of fewer than one repeat.
No server is started here (the end-to-end run is in tests/serve/test_bench_compare.py)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench import compare
from pdserve.bench.compare import (
    METRIC_KEYS,
    CompareSettings,
    add_compare_args,
    combine_repeats,
    every_run_completed,
    format_table,
    median_of_runs,
    merge_rounds,
    run_compare,
    settings,
)
from pdserve.bench.serve.client import RequestRecord
from pdserve.bench.serve.metrics import MAX_ERRORS, Slo, compute_metrics
from pdserve.bench.serve.runner import Load
from pdserve.bench.serve.workloads import Workload


def test_median_of_an_odd_count_is_the_middle_value() -> None:
    runs = [{"p99_itl_ms": 305.0, "completed": 6}, {"p99_itl_ms": 473.0, "completed": 5},
            {"p99_itl_ms": 350.0, "completed": 6}]
    assert median_of_runs(runs, ["p99_itl_ms", "completed"]) == {"p99_itl_ms": 350.0,
                                                                  "completed": 6}


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values() -> None:
    two = [{"p99_itl_ms": 305.0, "completed": 6}, {"p99_itl_ms": 473.0, "completed": 5}]
    assert median_of_runs(two, ["p99_itl_ms", "completed"]) == {"p99_itl_ms": 389.0,
                                                                 "completed": 5.5}
    four = [{"x": 10.0}, {"x": 1.0}, {"x": 3.0}, {"x": 2.0}]
    assert median_of_runs(four, ["x"]) == {"x": 2.5}  # (2 + 3) / 2


def test_a_run_without_a_value_is_left_out_of_that_median() -> None:
    runs = [{"tpot": None, "goodput": None, "nan": float("nan")},
            {"tpot": 100.0, "goodput": None, "nan": 4.0},
            {"tpot": 200.0, "nan": 8.0}]  # the third has no "goodput" key at all
    assert median_of_runs(runs, ["tpot", "goodput", "nan", "absent"]) == {
        "tpot": 150.0, "goodput": None, "nan": 6.0, "absent": None}


def test_median_of_no_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="no runs"):
        median_of_runs([], ["x"])


def test_metric_keys_are_every_numeric_key_of_compute_metrics() -> None:
    record = RequestRecord(prompt_tokens=3, max_tokens=2, send_s=0.0, token_times_s=(0.5, 0.75),
                           end_s=1.0, output_tokens=2)
    assert set(compute_metrics([record], Slo(ttft_ms=1000))) == {*METRIC_KEYS, "errors"}
    assert len(set(METRIC_KEYS)) == len(METRIC_KEYS)


def _run(p99_itl_ms: float | None, completed: int, errors: list[str], tag: str) -> dict:
    metrics = {k: 1.0 for k in METRIC_KEYS}
    return {**metrics, "p99_itl_ms": p99_itl_ms, "completed": completed, "errors": errors,
            "url": "http://x/v1", "seed": 0, "requests": [{"tag": tag}]}


def test_one_run_is_kept_as_is() -> None:
    run = _run(305.0, 6, [], "only")
    assert combine_repeats([run]) is run


def test_several_runs_give_medians_the_last_settings_and_requests_and_every_run() -> None:
    runs = [_run(305.0, 6, ["e1"], "first"), _run(None, 5, [], "second"),
            _run(473.0, 6, ["e2", "e3"], "third")]
    out = combine_repeats(runs)
    assert out["p99_itl_ms"] == 389.0 and out["completed"] == 6 and out["duration"] == 1.0
    assert out["seed"] == 0 and out["url"] == "http://x/v1"  # settings: the same in every run
    assert out["requests"] == [{"tag": "third"}]  # the last run's, which --plots draws
    assert out["errors"] == ["e1", "e2", "e3"]
    assert [r["p99_itl_ms"] for r in out["repeats"]] == [305.0, None, 473.0]
    assert all(set(r) == {*METRIC_KEYS, "errors", "requests"} for r in out["repeats"])
    assert list(out)[: len(METRIC_KEYS)] == list(METRIC_KEYS)  # a single run's key order


def test_every_round_keeps_its_requests_outcomes_without_their_token_gaps() -> None:
    """What pairs two configurations request by request over every round (paired_goodput)."""
    first, second = _run(1.0, 1, [], ""), _run(2.0, 1, [], "")
    first["requests"] = [{"ttft_s": 0.5, "tpot_s": 0.02, "e2e_s": 1.0, "ok": True,
                          "itl_s": [0.02] * 25, "start_s": 0.0},
                         {"ttft_s": None, "tpot_s": None, "e2e_s": 0.1, "ok": False}]
    second["requests"] = []  # a run that recorded none keeps no list
    out = combine_repeats([first, second])
    assert out["repeats"][0]["requests"] == [
        {"ok": True, "ttft_s": 0.5, "tpot_s": 0.02, "e2e_s": 1.0},
        {"ok": False, "ttft_s": None, "tpot_s": None, "e2e_s": 0.1}]
    assert "requests" not in out["repeats"][1]
    assert out["requests"] == []  # the last round's, whole


def test_errors_of_all_runs_are_capped() -> None:
    runs = [_run(1.0, 1, [f"r{i}-{j}" for j in range(MAX_ERRORS)], "") for i in range(2)]
    assert combine_repeats(runs)["errors"] == [f"r0-{j}" for j in range(MAX_ERRORS)]


def test_a_repeat_that_completed_nothing_fails_the_run() -> None:
    ok = combine_repeats([_run(1.0, 6, [], ""), _run(1.0, 6, [], "")])
    one_empty = combine_repeats([_run(1.0, 6, [], ""), _run(1.0, 0, [], ""),
                                 _run(1.0, 6, [], "")])
    assert one_empty["completed"] == 6  # the median hides it; the exit status does not
    assert every_run_completed({"a": ok, "b": _run(1.0, 1, [], "")})
    assert not every_run_completed({"a": ok, "b": one_empty})


def test_the_table_says_when_values_are_medians() -> None:
    results = {"a": {"completed": 10, "p99_itl_ms": 200.0},
               "b": {"completed": 10, "p99_itl_ms": 50.0}}
    assert format_table(results) == format_table(results, repeats=1)
    assert "median of" not in format_table(results)
    assert format_table(results, repeats=3).endswith(
        "each value is the median of 3 runs (--out keeps every run under 'repeats')")


def _settings(repeats: int) -> CompareSettings:
    return CompareSettings(configs=("collocated", "disagg"), externals=(("ext", "http://x/v1"),),
                           cores=1, model="m", workload=Workload(kind="chat"),
                           load=Load(rate=1.0, num_requests=2), slo=Slo(), timeout_s=10.0,
                           repeats=repeats)


def test_repeats_run_in_rounds_and_keep_every_rounds_steps(monkeypatch) -> None:
    calls: list[tuple[str, int]] = []

    def fake_config(s, name, repeat=0, bed=None):
        calls.append((name, repeat))
        return _run(100.0 * (len(calls)), 6, [], f"{name}{repeat}"), {"w": [[repeat]]}

    def fake_external(s, name, url, repeat=0):
        calls.append((name, repeat))
        return _run(100.0 * (len(calls)), 6, [], f"{name}{repeat}")

    monkeypatch.setattr(compare, "run_config", fake_config)
    monkeypatch.setattr(compare, "run_external", fake_external)
    results, traces = run_compare(_settings(repeats=2))
    assert calls == [("collocated", 0), ("disagg", 0), ("ext", 0),
                     ("collocated", 1), ("disagg", 1), ("ext", 1)]
    assert list(results) == ["collocated", "disagg", "ext"]
    assert results["collocated"]["p99_itl_ms"] == 250.0  # median of 100 and 400
    assert [r["p99_itl_ms"] for r in results["ext"]["repeats"]] == [300.0, 600.0]
    assert results["disagg"]["requests"] == [{"tag": "disagg1"}]
    assert traces == [{"collocated": {"w": [[0]]}, "disagg": {"w": [[0]]}},
                      {"collocated": {"w": [[1]]}, "disagg": {"w": [[1]]}}]
    assert merge_rounds(traces) == {"collocated": {"w": [[0], [1]]}, "disagg": {"w": [[0], [1]]}}
    assert results["collocated"]["steps_rounds"] == 2 == results["disagg"]["steps_rounds"]
    assert "steps_rounds" not in results["ext"]  # an external server records no steps


def test_merging_rounds_keeps_each_workers_steps_in_round_order() -> None:
    first = {"disagg": {"p0": [[1.0, 2.0]], "d0": [[1.5, 1.6], [1.6, 1.7]]}}
    second = {"disagg": {"d0": [[9.0, 9.1]], "p0": [[8.0, 8.5]]}, "elastic": {"d0": [[7.0, 7.5]]}}
    assert merge_rounds([first, second]) == {
        "disagg": {"p0": [[1.0, 2.0], [8.0, 8.5]],
                   "d0": [[1.5, 1.6], [1.6, 1.7], [9.0, 9.1]]},
        "elastic": {"d0": [[7.0, 7.5]]}}
    assert merge_rounds([first]) == first


def test_fewer_than_one_repeat_is_refused() -> None:
    with pytest.raises(ValueError, match="--repeats must be >= 1, got 0"):
        _settings(repeats=0)
    p = argparse.ArgumentParser()
    add_compare_args(p)
    assert p.parse_args([]).repeats == 1
    with pytest.raises(ValueError, match="--repeats"):
        settings(p.parse_args(["--repeats", "-1"]))
