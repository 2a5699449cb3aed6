"""A measured run's warm-up (bench compare serves two requests before the run) is served
first in the simulation: the router starts the run with the rates it reported, while the
run's records, ITLs, busy time and local prefills are the trace's alone."""

from __future__ import annotations

import pytest

from pdserve.planner.simulate.cluster import Layout
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.measured_run import load_measured_run
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.simulate.step_files import request, serve_result, write_json
from tests.planner.simulate.test_prefix_cache import LINEAR, linear_cluster

WARM = [TraceRequest(0.0, 300, 4), TraceRequest(0.0, 300, 4)]


def test_the_first_prompt_is_decided_on_the_rates_the_warm_up_reported():
    """Cold, a 300-token prompt is over the rule for unmeasured workers and splits; after the
    warm-up the measured rule keeps it on the idle decode worker (no link to cross). The
    warm-up's own local prefill is not counted."""
    cluster = linear_cluster(prefill_workers=1, decode_workers=1, split=SplitRule.MEASURED)
    trace = [TraceRequest(1.0, 300, 4)]
    cold = simulate(Layout.DISAGG, cluster, LINEAR, trace)
    warm = simulate(Layout.DISAGG, cluster, LINEAR, trace, warm_up=WARM)
    assert (cold.records[0].local, cold.local_prefills) == (False, 0)
    assert (warm.records[0].local, warm.local_prefills) == (True, 1)
    assert warm.records[0].arrival_s == 1.0  # times count from the trace's start


@pytest.mark.parametrize("layout", [Layout.COLLOC, Layout.CHUNKED])
def test_an_idle_workers_warm_up_changes_none_of_the_runs_figures(layout):
    cluster = linear_cluster(frontend_latency_s=0.01)
    trace = [TraceRequest(0.5, 200, 6), TraceRequest(9.0, 900, 5)]
    cold = simulate(layout, cluster, LINEAR, trace, trace_tokens=True)
    warm = simulate(layout, cluster, LINEAR, trace, trace_tokens=True, warm_up=WARM)
    for a, b in zip(cold.records, warm.records, strict=True):
        assert b.arrival_s == pytest.approx(a.arrival_s)
        assert b.token_times == pytest.approx(a.token_times)
        assert b.ttft_s == pytest.approx(a.ttft_s) and b.e2el_s == pytest.approx(a.e2el_s)
    assert [len(r.token_times or ()) for r in warm.records] == [6, 5]  # traced, not the warm-up's
    assert sorted(warm.itl.values) == pytest.approx(sorted(cold.itl.values))
    assert warm.itl.total == cold.itl.total == 5 + 4
    assert warm.busy == pytest.approx(cold.busy)


def test_a_run_keeps_bench_compares_warm_up_and_refuses_a_bad_one(tmp_path):
    one = serve_result([request(0.0, 100, 5)])
    path = write_json(tmp_path / "r.json", {"disagg": {**one, "warm_up": [
        {"prompt_tokens": 120, "output_tokens": 4}, {"prompt_tokens": 80, "output_tokens": 2}]}})
    run = load_measured_run(f"{path}:disagg", "x")
    assert run.warm_up == (TraceRequest(0.0, 120, 4), TraceRequest(0.0, 80, 2))
    assert load_measured_run(str(write_json(tmp_path / "o.json", one)), "x").warm_up == ()
    bad = write_json(tmp_path / "b.json", {**one, "warm_up": [{"prompt_tokens": 120}]})
    with pytest.raises(ValueError, match="warm-up request 1: missing output_tokens"):
        load_measured_run(str(bad), "x")
