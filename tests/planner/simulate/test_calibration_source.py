"""`--calibrate FILE[:CONFIG]`: steps files told apart from profiles and bench rows by shape,
one configuration chosen or all pooled, and what is wrong with a bad file named."""

from __future__ import annotations

import json

import pytest

from pdserve.planner.simulate.calibration import BenchRows, CalibrationProfile
from pdserve.planner.simulate.calibration_source import StepsProfile, load_calibration_source
from pdserve.planner.simulate.file_spec import parse_file_spec
from tests.planner.simulate.step_files import (
    C1,
    D0,
    D1,
    P0,
    P1,
    context_decode_steps,
    decode_steps,
    disagg_workers,
    prefill_steps,
    serve_result,
    write_json,
)
from tests.planner.simulate.test_calibration import bench_rows, write_rows
from tests.planner.simulate.test_measured import simulate_cli


@pytest.fixture
def compare_steps(tmp_path):
    """Two configurations on different machines: disagg as step_files', collocated twice as
    fast."""
    fast = {"collocated-0": decode_steps(D0 / 2, D1 / 2) + prefill_steps(P0 / 2, P1 / 2)}
    return write_json(tmp_path / "cmp.steps.json", {"disagg": disagg_workers(),
                                                    "collocated": fast})


def test_config_picks_one_configurations_workers(compare_steps):
    for config, scale in (("disagg", 1), ("collocated", 0.5)):
        source = load_calibration_source(f"{compare_steps}:{config}")
        assert isinstance(source, StepsProfile)
        p = source.profile
        assert p.decode_overhead_s == pytest.approx(D0 * scale, rel=1e-9)
        assert p.prefill_per_token_s == pytest.approx(P1 * scale, rel=1e-9)
        assert p.model is None and f"{compare_steps}:{config}" in p.source


def test_without_config_every_worker_of_every_configuration_is_pooled(compare_steps):
    p = load_calibration_source(str(compare_steps)).profile
    assert p.fit_rows == 2 * (25 + 12)
    assert D0 / 2 < p.decode_overhead_s + 3 * p.decode_per_seq_s < D0 + 3 * D1


def test_a_bare_worker_file_is_one_configuration(tmp_path):
    path = write_json(tmp_path / "w.json", disagg_workers())
    assert load_calibration_source(str(path)).profile.decode_per_seq_s == pytest.approx(D1)
    with pytest.raises(ValueError, match="one configuration's steps file: it has no "
                                         "configurations to choose 'disagg'"):
        load_calibration_source(f"{path}:disagg")


def test_unknown_config_lists_the_ones_there(compare_steps):
    with pytest.raises(ValueError, match=r"no configuration 'chunked' in this steps file "
                                         r"\(it has: 'disagg', 'collocated'\)"):
        load_calibration_source(f"{compare_steps}:chunked")


def test_decode_time_reaches_the_fit(tmp_path):
    path = write_json(tmp_path / "s.json", {"d": disagg_workers(gap=0.002)})
    assert load_calibration_source(str(path), "duration").profile.decode_overhead_s == (
        pytest.approx(D0))
    assert load_calibration_source(str(path)).profile.decode_overhead_s == (
        pytest.approx(D0 + 0.002))


def test_bad_step_rows_name_file_configuration_worker_and_step(compare_steps):
    data = json.loads(compare_steps.read_text())
    data["disagg"]["decode-0"][3] = [1.0, 2.0, 0, -4, 1]
    write_json(compare_steps, data)
    with pytest.raises(ValueError, match=r"cmp.steps.json configuration 'disagg' worker "
                                         r"'decode-0' step 4: decode_tokens must be"):
        load_calibration_source(f"{compare_steps}:disagg")


def test_old_formats_still_load(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", bench_rows())
    assert isinstance(load_calibration_source(str(rows)), BenchRows)
    profile = CalibrationProfile(decode_overhead_s=0.01, decode_per_seq_s=0.001,
                                 prefill_per_token_s=1e-4)
    path = write_json(tmp_path / "p.json", profile.to_dict())
    assert load_calibration_source(str(path)) == profile
    with pytest.raises(ValueError, match="is a calibration profile: it has no configurations"):
        load_calibration_source(f"{path}:disagg")


def test_a_results_file_points_at_its_steps(tmp_path):
    path = write_json(tmp_path / "cmp.json", {"disagg": serve_result([])})
    with pytest.raises(ValueError, match=r"bench results file; calibrate on the worker steps "
                                         r"beside it \(.*cmp.steps.json\)"):
        load_calibration_source(str(path))


def test_unreadable_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"calibrate \(--calibrate\) .*missing.json' cannot "
                                         "be read"):
        load_calibration_source(str(tmp_path / "missing.json"))


def test_an_existing_path_with_a_colon_is_taken_whole(tmp_path):
    path = write_json(tmp_path / "run:a.json", disagg_workers())
    assert parse_file_spec(str(path), "f").config is None
    spec = parse_file_spec(f"{tmp_path}/cmp.json:disagg", "f")
    assert (spec.path.name, spec.config) == ("cmp.json", "disagg")
    assert isinstance(load_calibration_source(str(path)), StepsProfile)


def test_a_held_decode_context_cost_is_fitted_around_and_named_in_the_source(tmp_path, capsys):
    steps = write_json(tmp_path / "a.steps.json", {"prefill-0": prefill_steps(),
                                                    "decode-0": context_decode_steps()})
    got = load_calibration_source(str(steps), context_token_s=C1)
    assert isinstance(got, StepsProfile)
    assert got.profile.decode_per_context_token_s == C1
    assert got.profile.source.endswith("decode context cost held at 10 us/token")
    rc, out, err = simulate_cli(capsys, "--calibrate", str(steps), "--decode-context-us", "10",
                                "--workload", "chat", "--num-requests", "3")
    assert rc == 0, err
    assert "+ 10.000 us/context token" in out
    rc, _, err = simulate_cli(capsys, "--calibrate", str(steps), "--decode-context-us", "-1",
                              "--workload", "chat", "--num-requests", "3")
    assert rc == 2 and "--decode-context-us must be a number of microseconds >= 0" in err


def test_a_held_decode_context_cost_needs_a_steps_file(tmp_path):
    profile = write_rows(tmp_path / "rows.jsonl", bench_rows())
    with pytest.raises(ValueError, match=r"is not a \.steps\.json"):
        load_calibration_source(str(profile), context_token_s=1e-6)
