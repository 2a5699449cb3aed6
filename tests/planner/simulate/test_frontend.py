"""The front end's round trip in the simulator: what it adds to TTFT and E2E (not to ITL), when a
closed loop's next request reaches its worker, its fit to a calibration run, and the flag."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pdserve.planner.simulate.cluster import Layout
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.frontend_fit import (
    CONVERGED_S,
    QUANTILE,
    calibration_run,
    fit_frontend_latency,
    latency_source,
    quantile,
)
from pdserve.planner.simulate.measured_run import MeasuredRun
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.simulate.step_files import (
    P0,
    P1,
    disagg_workers,
    request,
    serve_result,
    write_json,
)
from tests.planner.simulate.test_events import COSTS, cluster, gaps
from tests.planner.simulate.test_measured import simulate_cli

L = 0.05  # a 50 ms round trip
TRACE = [TraceRequest(0.0, 400, 6), TraceRequest(10.0, 800, 6)]


def test_a_round_trip_adds_to_ttft_and_e2e_but_not_to_the_gaps_between_tokens():
    base = simulate("colloc", cluster(), COSTS, TRACE, trace_tokens=True).records
    late = simulate("colloc", cluster(frontend_latency_s=L), COSTS, TRACE,
                    trace_tokens=True).records
    for a, b in zip(base, late, strict=True):
        assert b.arrival_s == a.arrival_s  # when the client sent it
        assert b.ttft_s == pytest.approx(a.ttft_s + L)
        assert b.e2el_s == pytest.approx(a.e2el_s + L)
        assert gaps(b) == pytest.approx(gaps(a))


def test_a_closed_loops_next_request_waits_for_the_step_it_reached_the_worker_in():
    """Two clients: one asks for 3 tokens, the other keeps decoding 60. With no round trip
    the first client's next request reaches the worker at the very end of the step that ended
    its last one and joins the next step; with one, it lands inside that next step (a decode
    step of the other stream) and waits for it, so its TTFT grows by more than the round trip.
    The client still sends it when it sees its last request end."""
    trace = [TraceRequest(0.0, 400, 3), TraceRequest(0.0, 400, 60), TraceRequest(0.0, 400, 3)]
    base = simulate("colloc", cluster(), COSTS, trace, clients=2).records
    small = 0.002  # well under one decode step
    late = simulate("colloc", cluster(frontend_latency_s=small), COSTS, trace, clients=2).records
    assert late[2].arrival_s == pytest.approx(late[0].finish_s)
    assert late[2].ttft_s > base[2].ttft_s + small + 0.001


@pytest.mark.parametrize("bad", [-0.001, math.inf, math.nan, True, "5"])
def test_a_bad_round_trip_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match=r"frontend_latency_s \(--frontend-latency-ms\)"):
        cluster(frontend_latency_s=bad)


# ten prompts of 100..1,000 tokens, 10 s apart: none waits for another
SPREAD = [TraceRequest(10.0 * i, 100 * (i + 1), 6) for i in range(10)]


def _run(ttfts: list[float], clients: int | None = None) -> MeasuredRun:
    return MeasuredRun("cal.json:collocated", "collocated", tuple(SPREAD),
                       {"median_ttft_ms": None}, len(ttfts), 0,
                       clients=clients, ttfts_s=tuple(ttfts))


def _simulated(latency: float, clients: int | None = None) -> list[float]:
    records = simulate("colloc", cluster(frontend_latency_s=latency), COSTS, SPREAD,
                       clients=clients).records
    return [r.ttft_s for r in records]


def test_the_fit_finds_the_round_trip_the_measured_ttfts_hold_beyond_the_steps():
    measured = [t + 0.040 for t in _simulated(0.0)]
    fitted = fit_frontend_latency(_run(measured), Layout.COLLOC, cluster(), COSTS)
    assert fitted == pytest.approx(0.040, abs=CONVERGED_S)


def test_queueing_the_model_missed_in_the_slow_half_is_not_taken_for_the_front_end():
    """The five slowest requests measured 2 s later than simulated (a queue the model did not
    see): the fit reads the fastest TTFTs, so it still finds 40 ms."""
    ttfts = sorted(_simulated(0.0))
    measured = [t + 0.040 + (2.0 if i >= 5 else 0.0) for i, t in enumerate(ttfts)]
    fitted = fit_frontend_latency(_run(measured), Layout.COLLOC, cluster(), COSTS)
    assert fitted == pytest.approx(0.040, abs=CONVERGED_S)


def test_a_run_faster_than_its_steps_fits_no_round_trip():
    measured = [t - 0.005 for t in _simulated(0.0)]
    assert fit_frontend_latency(_run(measured), Layout.COLLOC, cluster(), COSTS) == 0.0
    assert fit_frontend_latency(_run([]), Layout.COLLOC, cluster(), COSTS) == 0.0


def test_a_closed_loop_fit_lands_on_the_measured_quantile():
    measured = [t + 0.030 for t in _simulated(0.0, clients=2)]
    fitted = fit_frontend_latency(_run(measured, clients=2), Layout.COLLOC, cluster(), COSTS)
    got = quantile(_simulated(fitted, clients=2), QUANTILE)
    assert got == pytest.approx(quantile(measured, QUANTILE), abs=CONVERGED_S)


def test_idle_probes_measure_the_round_trip_whatever_the_runs_queues():
    """Probes of 32 tokens answered 20 ms after their own simulated prompt step at the
    fastest: L = 20 ms, though the run's requests (all 2 s late: a queue the model missed)
    would fit far more, and two probes slowed by a busy core (1.2 s, 0.5 s) move nothing."""
    alone = simulate("colloc", cluster(), COSTS, [TraceRequest(0.0, 32, 1)]).records[0].ttft_s
    run = replace(_run([t + 2.0 for t in _simulated(0.0)]), probe_prompt_tokens=32,
                  probe_ttfts_s=(alone + 1.2, alone + 0.5, alone + 0.020, alone + 0.025,
                                 alone + 0.030))
    assert fit_frontend_latency(run, Layout.COLLOC, cluster(), COSTS) == pytest.approx(0.020)
    assert latency_source(run) == "from the idle probes of cal.json:collocated"
    assert latency_source(_run([0.1])) == "fitted to the 10th-percentile TTFT of " \
                                          "cal.json:collocated"


def test_probes_with_their_own_steps_measure_the_round_trip_without_the_costs():
    """Each probe's TTFT less its own step in the workers' trace, the least of them: 3 ms,
    whatever the costs price a 32-token step at; without the steps, the fastest TTFT less
    that price."""
    run = replace(_run([0.1]), probe_prompt_tokens=32, probe_ttfts_s=(0.030, 0.5, 0.028),
                  probe_steps_s=(0.026, 0.020, 0.025))
    assert fit_frontend_latency(run, Layout.COLLOC, cluster(), COSTS) == pytest.approx(0.003)
    assert latency_source(run) == "from the idle probes of cal.json:collocated less their own " \
                                  "steps"
    alone = simulate("colloc", cluster(), COSTS, [TraceRequest(0.0, 32, 1)]).records[0].ttft_s
    from_costs = replace(run, probe_steps_s=())
    assert fit_frontend_latency(from_costs, Layout.COLLOC, cluster(), COSTS) == pytest.approx(
        0.028 - alone)


def test_quantiles_are_numpys_default():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.1) == pytest.approx(1.3)
    assert quantile([5.0], 0.1) == 5.0


# ---- the calibration run beside a steps file, and the command line ------------------------------

FLAG = "calibrate (--calibrate)"
# one 1000-token request on the step_files machine: its prefill step is P0 + P1 x 1000 = 210 ms
STEP_TTFT_MS = (P0 + P1 * 1000) * 1e3


@pytest.fixture
def calibrated(tmp_path):
    """cal.steps.json with cal.json beside it, its one TTFT 35 ms over its prefill step."""
    steps = write_json(tmp_path / "cal.steps.json", {"collocated": disagg_workers()})
    one = serve_result([request(0.0, 1000, 11, ttft_s=(STEP_TTFT_MS + 35.0) / 1e3)])
    write_json(tmp_path / "cal.json", {"collocated": one})
    held = write_json(tmp_path / "held.json", {"collocated": serve_result(
        [request(0.0, 1000, 11)], ttft_ms=300.0)})
    return steps, held


def test_the_run_beside_a_steps_file_is_found_only_for_one_configuration(calibrated):
    steps, _ = calibrated
    run = calibration_run(f"{steps}:collocated", FLAG)
    assert run is not None and run.label.endswith("cal.json:collocated")
    assert calibration_run(str(steps), FLAG) is None  # pooled configurations
    assert calibration_run(f"{steps}:disagg", FLAG) is None  # not in cal.json
    (steps.parent / "cal.json").unlink()
    assert calibration_run(f"{steps}:collocated", FLAG) is None


def test_simulate_fits_the_round_trip_to_the_calibration_run_and_says_so(calibrated, capsys):
    steps, held = calibrated
    rc, out, err = simulate_cli(capsys, "--calibrate", f"{steps}:collocated",
                                "--compare-measured", f"{held}:collocated", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["frontend_latency_ms"] == pytest.approx(35.0, abs=1.0)
    assert data["frontend_latency_source"].endswith("cal.json:collocated")
    assert data["measured"]["simulated"]["median_ttft_ms"] == pytest.approx(
        STEP_TTFT_MS + 35.0, abs=1.0)


def test_the_flag_overrides_the_fit_and_is_printed(calibrated, capsys):
    steps, held = calibrated
    rc, out, _ = simulate_cli(capsys, "--calibrate", f"{steps}:collocated",
                              "--compare-measured", f"{held}:collocated",
                              "--frontend-latency-ms", "12")
    assert rc == 0 and "front-end round trip: 12.0 ms (--frontend-latency-ms)" in out
    rc, _, err = simulate_cli(capsys, "--workload", "chat", "--frontend-latency-ms", "-1")
    assert rc == 2 and "--frontend-latency-ms must be a number of ms >= 0, got -1.0" in err


def test_without_a_calibration_run_there_is_no_round_trip(capsys):
    rc, out, _ = simulate_cli(capsys, "--workload", "chat", "--num-requests", "5")
    assert rc == 0 and "front-end round trip: 0.0 ms (none)" in out
