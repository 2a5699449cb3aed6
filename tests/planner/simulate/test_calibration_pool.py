"""`--calibrate FILE.steps.json:A+B`: several configurations' steps fitted as one, each priced
at A's speed by the speed references beside them; pools that cannot be priced so are refused."""

from __future__ import annotations

import json

import pytest

from pdserve.planner.simulate.calibration_pool import own_config, pool_names
from pdserve.planner.simulate.calibration_source import load_calibration_source
from pdserve.planner.simulate.frontend_fit import calibration_run
from tests.planner.simulate.step_files import (
    C1,
    D0,
    D1,
    P0,
    P1,
    PA,
    attention_prefill_steps,
    context_decode_steps,
    request,
    serve_result,
    write_json,
)

EXACT = (D0, D1, C1, P0, P1, PA)


def _steps(factor: float) -> list[list[float]]:
    """One worker's decode and prompt steps on the linear machine of step_files, every cost
    times `factor`."""
    d0, d1, c1, p0, p1, pa = (x * factor for x in EXACT)
    return context_decode_steps(d0, d1, c1) + attention_prefill_steps(p0, p1, pa)


def _ref(threads: int, prefill_s: float) -> dict:
    return {"threads": threads, "prefill_tokens": 512, "prefill_s": [prefill_s, prefill_s]}


@pytest.fixture
def run(tmp_path):
    """collocated at the machine's speed; chunked (the same threads) measured while the
    machine ran at half speed, as its reference says; disagg on 1 thread."""
    write_json(tmp_path / "cal.steps.json", {
        "collocated": {"collocated-0": _steps(1.0)},
        "chunked": {"collocated-0": _steps(2.0)},
        "disagg": {"decode-0": _steps(3.0)}})
    write_json(tmp_path / "cal.json", {
        "collocated": {**serve_result([request(0.0, 100, 4, ttft_s=0.05)]),
                       "speed_reference": _ref(2, 0.3)},
        "chunked": {**serve_result([request(0.0, 100, 4, ttft_s=0.5)]),
                    "speed_reference": _ref(2, 0.6)},
        "disagg": {**serve_result([request(0.0, 100, 4)]), "speed_reference": _ref(1, 0.6)}})
    return tmp_path / "cal.steps.json"


def _costs(spec: str) -> tuple[float, ...]:
    p = load_calibration_source(spec).profile
    return (p.decode_overhead_s, p.decode_per_seq_s, p.decode_per_context_token_s,
            p.prefill_overhead_s, p.prefill_per_token_s, p.prefill_per_attention_pair_s)


def test_pooled_steps_are_priced_at_the_first_configurations_speed(run):
    """chunked's steps, twice as long at half speed, join collocated's at its speed: the fit is
    collocated's machine exactly; named the other way round, chunked's."""
    alone = load_calibration_source(f"{run}:collocated").profile
    pooled = load_calibration_source(f"{run}:collocated+chunked").profile
    assert _costs(f"{run}:collocated+chunked") == pytest.approx(EXACT, rel=1e-6)
    assert pooled.fit_rows == 2 * alone.fit_rows
    assert f"{run}:collocated+chunked" in pooled.source
    assert _costs(f"{run}:chunked+collocated") == pytest.approx([2 * x for x in EXACT],
                                                                 rel=1e-6)


def test_without_the_speed_references_the_pool_would_be_wrong(run):
    """The same two configurations pooled as measured (FILE alone, disagg left out) fit
    neither machine: the scaling above is what makes the pool right."""
    steps = json.loads(run.read_text())
    del steps["disagg"]
    path = write_json(run.with_name("raw.steps.json"), steps)
    assert _costs(str(path)) != pytest.approx(EXACT, rel=0.05)


def test_the_calibration_run_of_a_pool_is_its_first_configurations(run):
    assert calibration_run(f"{run}:chunked+collocated", "calibrate").label.endswith(":chunked")
    assert calibration_run(f"{run}:collocated+chunked", "calibrate").label.endswith(
        ":collocated")


@pytest.mark.parametrize("spec, message", [
    ("collocated+disagg", r"only configurations whose workers computed on the same threads "
                          r"measured the same step costs; their speed references timed "
                          r"\{'collocated': 'a 512-token prefill on 2 threads', 'disagg': "
                          r"'a 512-token prefill on 1 threads'\}"),
    ("collocated+collocated", "a configuration named twice in 'collocated\\+collocated'"),
    ("collocated+", "an empty configuration name in 'collocated\\+'"),
    ("collocated+nope", "no configuration 'nope' in this steps file \\(it has: 'collocated', "
                        "'chunked', 'disagg'\\)"),
])
def test_a_pool_that_cannot_be_priced_at_one_speed_is_refused(run, spec, message):
    with pytest.raises(ValueError, match=message):
        load_calibration_source(f"{run}:{spec}")


def test_a_pool_needs_the_results_beside_the_steps_and_a_speed_reference_in_each(run):
    results = run.with_name("cal.json")
    text = results.read_text()
    write_json(results, {"collocated": {"speed_reference": _ref(2, 0.3)}, "chunked": {}})
    with pytest.raises(ValueError, match=r"pooled steps are priced at 'collocated''s speed by "
                                         r"the speed references in .*cal.json, where 'chunked' "
                                         r"has none"):
        load_calibration_source(f"{run}:collocated+chunked")
    results.unlink()
    with pytest.raises(ValueError, match=r"cal\.json, which cannot be read"):
        load_calibration_source(f"{run}:collocated+chunked")
    results.write_text(text)
    assert load_calibration_source(f"{run}:collocated").profile.fit_rows > 0


def test_names():
    assert pool_names("a+b") == ("a", "b") and pool_names(None) == ()
    assert own_config("a+b") == "a" and own_config("a") == "a" and own_config(None) is None


def test_a_pool_of_every_rounds_steps_is_priced_at_every_rounds_speed(run):
    """chunked's steps file keeps its two rounds (`steps_rounds`), timed 0.3 and 0.9 s: its
    steps join collocated's at 0.3 / mean(0.3, 0.9) = 1/2, as when its one round timed 0.6."""
    results = run.parent / "cal.json"
    data = json.loads(results.read_text())
    data["chunked"]["speed_reference"] = _ref(2, 0.9)  # the last round's alone says 1/3
    data["chunked"]["repeats"] = [{"speed_reference": _ref(2, 0.3)},
                                  {"speed_reference": _ref(2, 0.9)}]
    data["chunked"]["steps_rounds"] = 2
    results.write_text(json.dumps(data))
    assert _costs(f"{run}:collocated+chunked") == pytest.approx(EXACT, rel=1e-6)
