"""A held-out run's steps priced by a calibration profile: per kind, measured / priced, and its
share of the step time, in `pdserve simulate --compare-measured` and its JSON."""

from __future__ import annotations

import json

import pytest

from pdserve.planner.simulate import neighbour
from pdserve.planner.simulate.calibration import CalibrationProfile
from pdserve.planner.simulate.step_check import describe_ratios, step_ratios, steps_beside
from pdserve.planner.simulate.step_fit import Step
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
FLAG = "compare_measured (--compare-measured)"


def _decode(t: float, b: int, seconds: float) -> Step:
    return Step(t, t + seconds, 0, b, b, b, 0)


def test_each_kind_is_its_median_measured_over_priced_and_its_share_of_step_time():
    """Decode steps at B = 2 priced D0 + 2 D1 = 24 ms, measured 30 ms back to back (periods =
    durations): x1.25; one prompt of 1000 tokens priced 210 ms, measured 210 ms: x1.00; a
    mixed step (1000 tokens beside 2 decodes) priced max(P0, D0) + 200 + 4 = 224 ms, taking
    448 ms: x2.00."""
    t, steps = 0.0, []
    for _ in range(10):
        steps.append(_decode(t, 2, 0.030))
        t += 0.030
    steps.append(Step(t, t + 0.210, 1000, 0, 1, 0, 0))
    steps.append(Step(t + 0.210, t + 0.658, 1000, 2, 3, 2, 0))
    got = step_ratios(PROFILE, {"w": steps})
    assert got["decode"]["median_ratio"] == pytest.approx(1.25)
    assert got["prompt"]["median_ratio"] == pytest.approx(1.0)
    assert got["mixed"]["median_ratio"] == pytest.approx(2.0)
    assert got["decode"]["steps"] == 10 and got["mixed"]["steps"] == 1
    assert got["decode"]["share"] == pytest.approx(0.300 / (0.300 + 0.210 + 0.448))
    assert describe_ratios(got).startswith("decode x1.25 (time x1.25, 31% of step time), "
                                           "prompt x1.00 (time x1.00, 22% of step time)")


def test_the_time_ratio_weighs_each_step_by_its_seconds():
    """Nine light decode steps priced right and one heavy one (B = 35: priced 90 ms) taking
    twice its price: the median passes over it, the time ratio does not: (9 x 24 + 180) /
    (9 x 24 + 90) = 1.29."""
    steps = [_decode(i * 1.0, 2, 0.024) for i in range(9)] + [_decode(9.0, 35, 0.180)]
    got = step_ratios(PROFILE, {"w": steps})["decode"]
    assert got["median_ratio"] == pytest.approx(1.0)
    assert got["time_ratio"] == pytest.approx((9 * 0.024 + 0.180) / (9 * 0.024 + 0.090))


def test_a_decode_step_is_timed_by_its_period_unless_the_worker_then_idled():
    """A 24 ms step followed 6 ms later by the next: its period (30 ms, x1.25) is what a
    stream waited; followed 10 s later (idle), its duration (x1.00)."""
    busy = [_decode(0.0, 2, 0.024), _decode(0.030, 2, 0.024)]
    idle = [_decode(0.0, 2, 0.024), _decode(10.0, 2, 0.024)]
    assert step_ratios(PROFILE, {"w": busy})["decode"]["median_ratio"] == pytest.approx(1.125)
    assert step_ratios(PROFILE, {"w": idle})["decode"]["median_ratio"] == pytest.approx(1.0)


def _prefill(t: float, seconds: float) -> Step:
    return Step(t, t + seconds, 100, 0, 1, 0, 100)


def test_a_decode_workers_steps_are_split_by_whether_a_prefill_worker_computed_beside_them():
    """A prefill worker computing 0.5 s of every second; the decode worker's steps (B = 2,
    priced 24 ms) take 36 ms when one starts inside a prefill step (x1.5) and 24 ms when none
    overlaps it (x1.0); one that a prefill step starts into counts on neither side. With the
    neighbour.MIN_STEPS a side needs, the decode kind has both medians."""
    prefill, decode = [], []
    for i in range(neighbour.MIN_STEPS):
        t = float(i)
        prefill.append(_prefill(t, 0.5))
        decode.append(_decode(t + 0.1, 2, 0.036))  # beside
        decode.append(_decode(t + 0.6, 2, 0.024))  # alone
        decode.append(_decode(t + 0.98, 2, 0.060))  # the next prefill step starts into it
    steps = {"disagg/prefill-0": prefill, "disagg/decode-0": decode}
    placed = neighbour.place(steps)["disagg/decode-0"]
    assert placed[:3] == [(True, False), (False, True), (False, False)]
    got = step_ratios(PROFILE, steps)["decode"]
    assert (got["beside"], got["alone"]) == (pytest.approx(1.5), pytest.approx(1.0))
    assert "a decode worker's steps beside a computing prefill worker x1.50, alone x1.00" in \
        describe_ratios({"decode": got})
    fewer = {"disagg/prefill-0": prefill, "disagg/decode-0": decode[:-3]}
    assert "beside" not in step_ratios(PROFILE, fewer)["decode"]  # a step short on each side
    assert "beside" not in step_ratios(PROFILE, {"prefill-0": prefill, "w": decode})["decode"]


def test_a_long_neighbour_step_counts_behind_many_short_ones_of_another_neighbour():
    """Two prefill workers: one computes 0-5 s in one step, the other in twelve steps of 0.1 s,
    half a second apart from 1 s. A decode step at 4.7 s is beside the long one, though eight
    short steps started between the two; one at 6.12 s, between short steps, is alone; one at
    6.45 s, which the short step at 6.5 s starts into, is neither."""
    short = [_prefill(1.0 + 0.5 * i, 0.1) for i in range(12)]
    steps = {"prefill-0": [_prefill(0.0, 5.0)], "prefill-1": short,
             "decode-0": [_decode(4.7, 2, 0.02), _decode(6.12, 2, 0.02), _decode(6.45, 2, 0.1)]}
    assert neighbour.place(steps) == {"decode-0": [(True, False), (False, True),
                                                   (False, False)]}
    assert not neighbour.is_decode_worker("prefill-0") and neighbour.is_decode_worker(
        "disagg/decode-1")


def test_the_steps_beside_a_results_file_are_found_for_its_configuration(tmp_path):
    write_json(tmp_path / "b.json", {"disagg": serve_result([request(0.0, 1000, 11)])})
    assert steps_beside(f"{tmp_path / 'b.json'}:disagg", FLAG) is None  # no b.steps.json
    write_json(tmp_path / "b.steps.json", {"disagg": disagg_workers()})
    got = steps_beside(f"{tmp_path / 'b.json'}:disagg", FLAG)
    assert set(got) == {"disagg/prefill-0", "disagg/decode-0"}
    assert steps_beside(f"{tmp_path / 'b.json'}:collocated", FLAG) is None


def test_simulate_prints_the_held_out_steps_priced_by_the_calibration(tmp_path, capsys):
    """Calibrated on a's steps; b ran on a machine 1.5 times slower: every kind x1.50."""
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    slow = {"prefill-0": [[a * 1.5, b * 1.5, *rest] for a, b, *rest in
                          disagg_workers()["prefill-0"]],
            "decode-0": [[a * 1.5, b * 1.5, *rest] for a, b, *rest in
                         disagg_workers()["decode-0"]]}
    write_json(tmp_path / "b.steps.json", {"disagg": slow})
    results = write_json(tmp_path / "b.json", {"disagg": serve_result([request(0.0, 1000, 11)])})
    argv = ["--calibrate", f"{steps}:disagg", "--compare-measured", f"{results}:disagg"]
    rc, out, err = simulate_cli(capsys, *argv)
    assert rc == 0, err
    assert "its steps, measured / priced by the calibration: decode x1.50" in out
    assert "prompt x1.50" in out
    rc, out, _ = simulate_cli(capsys, *argv, "--json")
    ratios = json.loads(out)["measured"]["step_ratios"]
    assert set(ratios) == {"decode", "prompt"}
    assert ratios["decode"]["median_ratio"] == pytest.approx(1.5)
