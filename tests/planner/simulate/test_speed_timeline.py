"""`--speed-reference steps`: a measured run priced at its own steps' speed, window by window
(a diagnostic that takes the machine's drift within the run out of the simulator's misses)."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.planner.simulate.calibration import CalibrationProfile
from pdserve.planner.simulate.cluster import Cluster
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.speed_timeline import SpeedTimeline, build_timeline
from pdserve.planner.simulate.step_fit import Step
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.simulate.step_files import (
    D0,
    D1,
    P0,
    P1,
    disagg_workers,
    request,
    serve_result,
    write_json,
)
from tests.planner.simulate.test_measured import simulate_cli

PROFILE = CalibrationProfile(decode_overhead_s=D0, decode_per_seq_s=D1, prefill_per_token_s=P1,
                             prefill_overhead_s=P0)
PROMPT_400 = P0 + P1 * 400  # the profile's price of a 400-token prompt step


def _prompt(start: float, factor: float) -> Step:
    return Step(start, start + PROMPT_400 * factor, 400, 0, 1)


def test_each_window_is_its_steps_measured_over_priced_and_an_empty_one_the_runs():
    """Prompt steps at x1 in window 0 and x3 in window 1 (a 2 s window); decode steps only in
    window 1 at x1.5: window 0's decode factor is the run's; steps before the run are left out."""
    steps = {"prefill-0": [_prompt(99.0, 10.0), _prompt(100.1, 1.0), _prompt(100.5, 1.0),
                           _prompt(102.2, 3.0)],
             "decode-0": [Step(102.5, 102.5 + (D0 + 4 * D1) * 1.5, 0, 4, 4)]}
    t = build_timeline(PROFILE, steps, origin_s=100.0)
    assert t.prompt == pytest.approx((1.0, 3.0)) and t.decode == pytest.approx((1.5, 1.5))
    assert t.prompt_run == pytest.approx((2 + 3) / 3)  # measured seconds over priced, pooled
    assert t.factor(-5.0, prompt=True) == pytest.approx(1.0)  # the warm-up: window 0
    assert t.factor(-math.inf, prompt=False) == pytest.approx(1.5)
    assert t.factor(3.9, prompt=True) == pytest.approx(3.0)
    assert t.factor(4.0, prompt=True) == pytest.approx(5 / 3)  # past the run: the run's
    assert t.spread() == pytest.approx((1.0, 3.0))


def test_a_window_longer_than_the_run_gives_one_factor_per_kind_for_the_whole_run():
    steps = {"prefill-0": [_prompt(100.1, 1.0), _prompt(102.2, 3.0)]}
    t = build_timeline(PROFILE, steps, origin_s=100.0, window_s=1000.0)
    assert t.prompt == pytest.approx((2.0,)) and t.decode == (1.0,)  # no decode step: 1


def test_a_decode_step_is_timed_by_its_period_as_the_fit_times_it():
    """Two decode steps back to back with a 10 ms gap between them: the first counts to the
    second's start (what a stream waits), the last by its duration."""
    d = D0 + D1
    steps = {"decode-0": [Step(0.0, d, 0, 1, 1), Step(d + 0.01, 2 * d + 0.01, 0, 1, 1)]}
    t = build_timeline(PROFILE, steps, origin_s=0.0)
    assert t.decode == pytest.approx(((2 * d + 0.01) / (2 * d),))


def test_steps_that_computed_nothing_give_no_speed():
    with pytest.raises(ValueError, match="no step that computed anything"):
        build_timeline(PROFILE, {"decode-0": [Step(0.0, 0.0, 0, 1, 1)]}, origin_s=0.0)
    with pytest.raises(ValueError, match="window must be > 0"):
        build_timeline(PROFILE, {"decode-0": [Step(0.0, 0.1, 0, 1, 1)]}, 0.0, window_s=0.0)


def _cluster() -> Cluster:
    return Cluster(kv_capacity_tokens=100_000, kv_bytes_per_token_rank=1, link_gbps=100.0,
                   collocated_workers=1)


def test_a_simulated_step_costs_its_price_times_the_factor_where_it_starts():
    """One 400-token prompt at 0.5 s (window 0 at x2) and one at 3 s (window 1 at x1): the
    first's TTFT is twice its price, the second's its price; decode steps at x1.5."""
    timeline = SpeedTimeline(2.0, (2.0, 1.0), (1.5, 1.5), 1.0, 1.5)
    trace = [TraceRequest(0.5, 400, 1), TraceRequest(3.0, 400, 3)]
    plain = simulate("colloc", _cluster(), PROFILE, trace, trace_tokens=True).records
    timed = simulate("colloc", _cluster(), PROFILE, trace, trace_tokens=True,
                     speed=timeline).records
    assert plain[0].ttft_s == pytest.approx(PROMPT_400)
    assert timed[0].ttft_s == pytest.approx(2 * PROMPT_400)
    assert timed[1].ttft_s == pytest.approx(PROMPT_400)
    gaps = [b - a for a, b in zip(timed[1].token_times, timed[1].token_times[1:], strict=False)]
    assert gaps == pytest.approx([1.5 * (D0 + D1)] * 2)


def _slower_run(tmp_path, window: list[float] | None = None, **extra) -> list[str]:
    """a: the calibration; b: the same workers' steps 1.5 times slower, b's run started at the
    first step (its wall clock) unless `window` says otherwise."""
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    write_json(tmp_path / "a.json", {"disagg": serve_result([request(0.0, 1000, 11)])})
    slower = {w: [[a * 1.5, b * 1.5, *rest] for a, b, *rest in rows]
              for w, rows in disagg_workers().items()}
    write_json(tmp_path / "b.steps.json", {"disagg": slower})
    result = {**serve_result([request(0.0, 1000, 11)]), **extra}
    if window is not None:
        result["run_window"] = window
    results = write_json(tmp_path / "b.json", {"disagg": result})
    return ["--calibrate", f"{steps}:disagg", "--compare-measured", f"{results}:disagg",
            "--json"]


def test_simulate_prices_a_run_at_its_own_steps_speed(tmp_path, capsys):
    """b's steps ran 1.5x their price throughout: under steps the simulated ITL is 1.5x the
    unscaled one, and the comparison says how it was priced."""
    argv = _slower_run(tmp_path, window=[1500.0, 1600.0])
    rc, out, err = simulate_cli(capsys, *argv, "--speed-reference", "ignore")
    assert rc == 0, err
    plain = json.loads(out)["measured"]
    rc, out, err = simulate_cli(capsys, *argv, "--speed-reference", "steps")
    assert rc == 0, err
    got = json.loads(out)["measured"]
    assert got["simulated"]["median_itl_ms"] == pytest.approx(
        1.5 * plain["simulated"]["median_itl_ms"])
    t = got["speed_timeline"]
    assert (t["prompt_run"], t["decode_run"]) == pytest.approx((1.5, 1.5))
    assert got["speed_scale"] is None
    rc, out, _ = simulate_cli(capsys, *argv[:-1], "--speed-reference", "steps")
    assert "priced at the run's own steps' speed by 2 s window (a diagnostic" in out
    assert "prompt steps x1.50, decode x1.50" in out
    rc, out, _ = simulate_cli(capsys, *argv, "--speed-reference", "steps", "--speed-window", "5")
    assert json.loads(out)["measured"]["speed_timeline"]["window_s"] == 5.0
    rc, _, err = simulate_cli(capsys, *argv, "--speed-reference", "steps", "--speed-window", "0")
    assert rc == 2 and "window must be > 0 seconds" in err
    rc, _, err = simulate_cli(capsys, *argv, "--speed-window", "5")
    assert rc == 2 and "--speed-window sets the windows of --speed-reference steps; here the " \
        "speed reference is 'scale'" in err


@pytest.mark.parametrize("window, extra, message", [
    (None, {}, "has no run_window"),
    ([1500.0, 1600.0], {"repeats": [{}, {}]}, "has 2 rounds"),
    ([1600.0, 1500.0], {}, "run_window must be [start, end]"),
])
def test_steps_pricing_needs_one_rounds_run_with_its_window(tmp_path, capsys, window, extra,
                                                            message):
    argv = _slower_run(tmp_path, window=window, **extra)
    rc, _, err = simulate_cli(capsys, *argv, "--speed-reference", "steps")
    assert rc == 2 and message in err


def test_steps_pricing_needs_the_measured_runs_steps(tmp_path, capsys):
    argv = _slower_run(tmp_path, window=[1500.0, 1600.0])
    (tmp_path / "b.steps.json").unlink()
    rc, _, err = simulate_cli(capsys, *argv, "--speed-reference", "steps")
    assert rc == 2 and "reads the steps beside" in err
    rc, _, err = simulate_cli(capsys, "--calibrate", f"{tmp_path / 'a.steps.json'}:disagg",
                              "--speed-reference", "steps", "--rate", "1")
    assert rc == 2 and "give --calibrate and --compare-measured" in err
