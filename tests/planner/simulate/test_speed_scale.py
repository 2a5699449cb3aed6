"""A calibration scaled to the held-out run's speed: bench compare's speed references around
each run, read from the results, and the profile's costs scaled by their ratio in `pdserve
simulate --compare-measured`."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.planner.simulate.calibration import CalibrationProfile
from pdserve.planner.simulate.speed_scale import (
    SpeedReference,
    decode_factor,
    parse_cost_scale,
    read_rounds_reference,
    read_speed_reference,
    read_steps_reference,
    scale_costs,
    scale_profile,
    speed_factor,
)
from tests.planner.simulate.step_files import disagg_workers, request, serve_result, write_json
from tests.planner.simulate.test_measured import simulate_cli


def reference(prefill_s: list[float], threads: int = 1, decode_step_s: list[float] | None = None
              ) -> dict[str, object]:
    decode = {} if decode_step_s is None else {
        "decode_streams": 8, "decode_prompt_tokens": 128, "decode_step_s": decode_step_s}
    return {"threads": threads, "prefill_tokens": 512, "prefill_s": prefill_s, **decode}


def test_the_factor_is_the_mean_of_the_measured_bracket_over_the_calibrations():
    a = read_speed_reference({"speed_reference": reference([0.4, 0.6])}, "a")
    b = read_speed_reference({"speed_reference": reference([0.9, 0.6])}, "b")
    assert speed_factor(a, b) == pytest.approx(1.5)


def test_a_run_without_a_reference_has_none_and_a_malformed_one_is_refused():
    assert read_speed_reference({}, "b") is None
    for bad in (reference([]), reference([-1.0]), reference([0.4], 0), reference([True]),
                {"threads": 1}, [0.4]):
        with pytest.raises(ValueError, match="b: speed_reference must be"):
            read_speed_reference({"speed_reference": bad}, "b")


def test_references_of_different_jobs_are_refused():
    one, two = SpeedReference(1, 512, (0.4,)), SpeedReference(2, 512, (0.4,))
    with pytest.raises(ValueError, match=r"timed different jobs.*on 1 threads.*on 2 threads"):
        speed_factor(one, two)


def test_every_cost_scales_by_the_factor_and_a_held_context_cost_stays():
    p = CalibrationProfile(decode_overhead_s=0.02, decode_per_seq_s=0.002,
                           prefill_per_token_s=2e-4, prefill_overhead_s=0.01,
                           decode_per_context_token_s=1e-6, prefill_per_attention_pair_s=1e-8)
    got = scale_profile(p, 1.5, context_held=False)
    assert (got.prefill_overhead_s, got.prefill_per_token_s, got.prefill_per_attention_pair_s) \
        == pytest.approx((0.015, 3e-4, 1.5e-8))
    assert (got.decode_overhead_s, got.decode_per_seq_s, got.decode_per_context_token_s) \
        == pytest.approx((0.03, 0.003, 1.5e-6))
    held = scale_profile(p, 1.5, context_held=True)
    assert held.decode_per_context_token_s == 1e-6 and held.decode_per_seq_s == 0.003
    bent = replace(p, decode_knee_batch=5, decode_per_seq_past_knee_s=0.004)
    got = scale_profile(bent, 1.5, context_held=True)
    assert (got.decode_knee_batch, got.decode_per_seq_past_knee_s) == (5, pytest.approx(0.006))


def test_the_decode_jobs_factor_is_its_own_mean_ratio_and_needs_the_same_job_in_both():
    a = read_speed_reference({"speed_reference": reference([0.4], 1, [0.02, 0.04])}, "a")
    b = read_speed_reference({"speed_reference": reference([0.4], 1, [0.045, 0.045])}, "b")
    assert (speed_factor(a, b), decode_factor(a, b)) == (1.0, pytest.approx(1.5))
    old = read_speed_reference({"speed_reference": reference([0.4])}, "old")
    assert old.decode_job is None and decode_factor(old, b) is None
    assert decode_factor(a, replace(b, decode_job=(4, 128))) is None
    rounds = {"repeats": [{"speed_reference": reference([0.4], 1, [0.02])},
                          {"speed_reference": reference([0.4], 1, [0.04])}]}
    assert read_rounds_reference(rounds, "r").decode_step_s == (0.02, 0.04)
    rounds["repeats"][0]["speed_reference"] = reference([0.4])  # one round without it
    pooled = read_rounds_reference(rounds, "r")
    assert pooled.prefill_s == (0.4, 0.4) and pooled.decode_job is None


@pytest.mark.parametrize("bad", [
    {"decode_streams": 8},  # the decode job's keys come together
    {"decode_streams": 0, "decode_prompt_tokens": 128, "decode_step_s": [0.02]},
    {"decode_streams": 8, "decode_prompt_tokens": 128, "decode_step_s": []},
])
def test_a_malformed_decode_job_is_refused(bad):
    with pytest.raises(ValueError, match="b: speed_reference's decode job needs"):
        read_speed_reference({"speed_reference": {**reference([0.4]), **bad}}, "b")


def test_split_scales_the_prompt_terms_by_one_factor_and_the_decode_terms_by_the_other():
    p = CalibrationProfile(decode_overhead_s=0.02, decode_per_seq_s=0.002,
                           prefill_per_token_s=2e-4, prefill_overhead_s=0.01,
                           decode_per_context_token_s=1e-6, decode_knee_batch=5,
                           decode_per_seq_past_knee_s=0.004)
    got = scale_profile(p, 1.5, context_held=False, decode=2.0)
    assert (got.prefill_overhead_s, got.prefill_per_token_s) == pytest.approx((0.015, 3e-4))
    assert (got.decode_overhead_s, got.decode_per_seq_s, got.decode_per_seq_past_knee_s,
            got.decode_per_context_token_s) == pytest.approx((0.04, 0.004, 0.008, 2e-6))
    assert scale_profile(p, 1.5, context_held=True, decode=2.0).decode_per_context_token_s == 1e-6


def _slower(factor: float) -> dict[str, list[list[float]]]:
    return {w: [[a * factor, b * factor, *rest] for a, b, *rest in steps]
            for w, steps in disagg_workers().items()}


def _runs(tmp_path, a_ref, b_ref):
    """a: the calibration (steps and results); b: the same machine 1.5 times slower."""
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    write_json(tmp_path / "a.json", {"disagg": {**serve_result([request(0.0, 1000, 11)]),
                                                "speed_reference": a_ref}})
    write_json(tmp_path / "b.steps.json", {"disagg": _slower(1.5)})
    results = write_json(tmp_path / "b.json", {"disagg": {
        **serve_result([request(0.0, 1000, 11)]), "speed_reference": b_ref}})
    return ["--calibrate", f"{steps}:disagg", "--compare-measured", f"{results}:disagg"]


def test_simulate_prices_a_slower_run_at_its_own_speed(tmp_path, capsys):
    """The held-out run's references say 1.5x slower: its own steps, priced by the scaled
    calibration, come out x1.00 (unscaled: x1.50)."""
    argv = _runs(tmp_path, reference([0.4, 0.4]), reference([0.5, 0.7]))
    rc, out, err = simulate_cli(capsys, *argv)
    assert rc == 0, err
    assert "calibration scaled x1.500 to the run's speed reference" in out
    assert "decode x1.00" in out and "prompt x1.00" in out
    rc, out, _ = simulate_cli(capsys, *argv, "--json")
    got = json.loads(out)
    assert got["measured"]["speed_scale"] == pytest.approx(1.5)
    assert got["measured"]["step_ratios"]["decode"]["median_ratio"] == pytest.approx(1.0)
    rc, out, _ = simulate_cli(capsys, *argv, "--json", "--speed-reference", "ignore")
    got = json.loads(out)
    assert got["measured"]["speed_scale"] is None
    assert got["measured"]["step_ratios"]["decode"]["median_ratio"] == pytest.approx(1.5)


def test_split_prices_the_decode_steps_by_the_decode_job(tmp_path, capsys):
    """The held-out steps are all 1.5x slower; the prefill job says x1.0, the decode job x1.5:
    scale leaves the decode steps x1.50 and reports the decode job's factor, split prices them
    x1.00; split is refused where a run did not time the decode job."""
    argv = _runs(tmp_path, reference([0.4], 1, [0.02]), reference([0.4], 1, [0.03]))
    rc, out, err = simulate_cli(capsys, *argv)
    assert rc == 0, err
    assert "calibration scaled x1.000 to the run's speed reference (its decode job: x1.500, " \
        "not applied)" in out and "decode x1.50" in out
    rc, out, _ = simulate_cli(capsys, *argv, "--json", "--speed-reference", "split")
    got = json.loads(out)["measured"]
    assert (got["speed_scale"], got["decode_speed_scale"], got["speed_split"]) == \
        (1.0, pytest.approx(1.5), True)
    assert got["step_ratios"]["decode"]["median_ratio"] == pytest.approx(1.0)
    assert got["step_ratios"]["prompt"]["median_ratio"] == pytest.approx(1.5)
    rc, out, _ = simulate_cli(capsys, *argv, "--speed-reference", "split")
    assert "decode costs x1.500 (decode job)" in out
    argv = _runs(tmp_path, reference([0.4]), reference([0.4], 1, [0.03]))
    rc, _, err = simulate_cli(capsys, *argv, "--speed-reference", "split")
    assert rc == 2 and "--speed-reference split needs the decode job timed around both" in err


def test_simulate_refuses_references_of_different_jobs(tmp_path, capsys):
    argv = _runs(tmp_path, reference([0.4], threads=2), reference([0.6]))
    rc, _, err = simulate_cli(capsys, *argv)
    assert rc == 2 and "timed different jobs" in err and "--speed-reference ignore" in err


def test_scale_costs_multiplies_each_family_of_terms_held_context_included():
    p = CalibrationProfile(decode_overhead_s=0.02, decode_per_seq_s=0.002,
                           prefill_per_token_s=2e-4, prefill_overhead_s=0.01,
                           decode_per_context_token_s=1e-6, prefill_per_attention_pair_s=1e-8)
    got = scale_costs(p, parse_cost_scale("prefill=2, decode=0.5"))
    assert (got.prefill_overhead_s, got.prefill_per_token_s, got.prefill_per_attention_pair_s) \
        == pytest.approx((0.02, 4e-4, 2e-8))
    assert (got.decode_overhead_s, got.decode_per_seq_s, got.decode_per_context_token_s) \
        == pytest.approx((0.01, 0.001, 0.5e-6))
    assert scale_costs(p, parse_cost_scale("decode=3")).prefill_per_token_s == 2e-4


@pytest.mark.parametrize(("text", "message"), [
    ("prefil=2", "KIND one of prefill, decode, got 'prefil=2'"),
    ("prefill", "KIND=FACTOR"),
    ("decode=-1", "decode: the factor must be a positive number, got '-1'"),
    ("decode=nan", "positive number"),
    ("prefill=x", "positive number, got 'x'"),
    (",", "at least one KIND=FACTOR"),
])
def test_bad_cost_scales_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_cost_scale(text)


def test_scale_costs_prices_the_run_as_the_user_says(tmp_path, capsys):
    """Unscaled by the references, the 1.5x slower run's steps price x1.50; --scale-costs
    decode=1.5 prices its decode steps at x1.00 and leaves its prompts at x1.50."""
    argv = [*_runs(tmp_path, reference([0.4]), reference([0.6])), "--json",
            "--speed-reference", "ignore"]
    rc, out, err = simulate_cli(capsys, *argv, "--scale-costs", "decode=1.5")
    assert rc == 0, err
    ratios = json.loads(out)["measured"]["step_ratios"]
    assert ratios["decode"]["median_ratio"] == pytest.approx(1.0)
    assert ratios["prompt"]["median_ratio"] == pytest.approx(1.5)
    rc, _, err = simulate_cli(capsys, "--model", "smollm2-135m", "--scale-costs", "decode=2")
    assert rc == 2 and "--scale-costs scales fitted costs: give --calibrate" in err


def test_a_run_of_several_rounds_pools_every_rounds_reference():
    rounds = {"speed_reference": reference([0.6, 0.6]),
              "repeats": [{"speed_reference": reference([0.4, 0.4])},
                          {"speed_reference": reference([0.6, 0.6])}]}
    pooled = read_rounds_reference(rounds, "b")
    assert pooled == SpeedReference(1, 512, (0.4, 0.4, 0.6, 0.6))
    assert read_speed_reference(rounds, "b").prefill_s == (0.6, 0.6)  # the last round's
    assert read_rounds_reference({"speed_reference": reference([0.5])}, "b").prefill_s == (0.5,)
    unlike = {"repeats": [{"speed_reference": reference([0.4])},
                          {"speed_reference": reference([0.4], threads=2)}]}
    assert read_rounds_reference(unlike, "b") is None
    assert read_rounds_reference({"repeats": [{"speed_reference": reference([0.4])}, {}]},
                                 "b") is None


def _rounds(results: Path, prefill_s: list[float], **extra: object) -> None:
    """Give the disagg run in `results` one round per timing in `prefill_s` (and `extra`
    keys, such as steps_rounds)."""
    data = json.loads(results.read_text())
    data["disagg"] |= {"repeats": [{"speed_reference": reference([s])} for s in prefill_s],
                       **extra}
    results.write_text(json.dumps(data))


def _speed_scale(capsys, argv: list[str]) -> float:
    rc, out, err = simulate_cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)["measured"]["speed_scale"]


def test_simulate_prices_a_repeated_run_at_all_its_rounds_speed(tmp_path, capsys):
    """The held-out run's rounds timed 0.5 and 0.7 s (the last round 0.7): its median
    figures are priced at 0.6 / 0.4 = 1.5, not at the last round's 1.75."""
    argv = _runs(tmp_path, reference([0.4]), reference([0.7]))
    _rounds(tmp_path / "b.json", [0.5, 0.7])
    assert _speed_scale(capsys, argv) == pytest.approx(1.5)


def test_a_calibration_is_priced_at_the_rounds_its_steps_come_from():
    """Steps of every round (`steps_rounds` = the rounds): every round's timings pooled; of the
    last round (no key, or 1): that round's; any other count is refused."""
    rounds = [{"speed_reference": reference([0.4])}, {"speed_reference": reference([0.6])}]
    every = {"speed_reference": reference([0.6]), "repeats": rounds, "steps_rounds": 2}
    assert read_steps_reference(every, "a").prefill_s == (0.4, 0.6)
    last = {"speed_reference": reference([0.6]), "repeats": rounds}
    assert read_steps_reference(last, "a").prefill_s == (0.6,)
    assert read_steps_reference({**last, "steps_rounds": 1}, "a").prefill_s == (0.6,)
    for bad in (3, 0, "2", True):
        with pytest.raises(ValueError, match=r"a: steps_rounds must be 1 or the run's 2 rounds"):
            read_steps_reference({**last, "steps_rounds": bad}, "a")


def test_simulate_scales_a_calibration_of_every_rounds_steps_by_every_round(tmp_path, capsys):
    """The calibration's rounds timed 0.2 and 0.6 s and its steps file keeps both rounds: the
    held-out run (0.6 s) is priced at 0.6 / 0.4 = 1.5; a file of the last round's steps alone
    at 0.6 / 0.6 = 1."""
    argv = _runs(tmp_path, reference([0.6]), reference([0.6]))
    _rounds(tmp_path / "a.json", [0.2, 0.6])
    assert _speed_scale(capsys, argv) == pytest.approx(1.0)
    _rounds(tmp_path / "a.json", [0.2, 0.6], steps_rounds=2)
    assert _speed_scale(capsys, argv) == pytest.approx(1.5)
