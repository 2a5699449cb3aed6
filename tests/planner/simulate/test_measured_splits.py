"""`pdserve simulate --compare-measured` shows a split layout's local prefills: the router's
(the bench compare result's `split_decisions`) beside the simulation's, informational; a
results file without them still compares ("-")."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.planner.simulate.measured_run import load_measured_run
from tests.planner.cli_run import run_pdserve
from tests.planner.simulate.step_files import disagg_workers, request, serve_result, write_json

SPLITS = {"local": 1, "remote": 18,
          "by_reason": {"local/measured_cost": 1, "remote/measured_cost": 18}}


@pytest.fixture
def files(tmp_path):
    """Steps to calibrate on, and a run whose disagg configuration recorded its split
    decisions and whose older copy did not."""
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    one = serve_result([request(0.0, 1000, 11)], ttft_ms=231.0, itl_ms=20.0)
    results = write_json(tmp_path / "b.json", {"disagg": {**one, "split_decisions": SPLITS},
                                                "collocated": one})
    old = write_json(tmp_path / "old.json", {"disagg": one})
    return steps, results, old


def simulate(capsys, steps, measured: str, *args: str) -> tuple[int, str, str]:
    return run_pdserve(["simulate", "--model", "smollm2-135m", "--gpu", "cpu", "--calibrate",
                        f"{steps}:disagg", "--compare-measured", measured, *args], capsys)


def test_a_compare_result_carries_the_routers_local_prefills(files):
    _, results, old = files
    assert load_measured_run(f"{results}:disagg", "x").local_prefills == 1
    assert load_measured_run(f"{results}:collocated", "x").local_prefills is None
    assert load_measured_run(str(old), "x").local_prefills is None


def test_the_disagg_comparison_shows_measured_and_simulated_local_prefills(files, capsys):
    steps, results, _ = files
    rc, out, err = simulate(capsys, steps, f"{results}:disagg", "--json")
    assert rc == 0, err
    data = json.loads(out)
    simulated = data["results"][0]["local_prefills"]
    assert data["measured"]["local_prefills"] == {"measured": 1, "simulated": simulated}
    rc, out, _ = simulate(capsys, steps, f"{results}:disagg")
    assert rc == 0 and re.search(rf"local prefills +1 +{simulated} +\(measured: the router's", out)


def test_an_older_file_shows_a_dash_and_a_collocated_run_no_row(files, capsys):
    steps, results, old = files
    rc, out, _ = simulate(capsys, steps, str(old))
    assert rc == 0 and re.search(r"local prefills +- +\d+ ", out)
    rc, out, _ = simulate(capsys, steps, str(old), "--json")
    assert json.loads(out)["measured"]["local_prefills"]["measured"] is None
    rc, out, _ = simulate(capsys, steps, f"{results}:collocated", "--json")
    assert rc == 0 and "local_prefills" not in json.loads(out)["measured"]


def test_a_bad_count_is_refused(tmp_path, files):
    one = serve_result([request(0.0, 1000, 11)])
    bad = write_json(tmp_path / "bad.json", {"disagg": {**one, "split_decisions": {"local": -1}}})
    with pytest.raises(ValueError, match="split_decisions local must be a count >= 0, got -1"):
        load_measured_run(f"{bad}:disagg", "x")
