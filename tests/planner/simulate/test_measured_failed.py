"""`pdserve simulate --compare-measured` sets the measured run's failed requests beside the
requests the simulation's admission refused: always in the JSON, in the table when either side
has any."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.planner.simulate.measured_compare import compare, comparison_json, render_comparison
from pdserve.planner.simulate.measured_run import METRICS, MeasuredRun
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.cli_run import run_pdserve
from tests.planner.simulate.step_files import disagg_workers, request, serve_result, write_json

ROW = re.compile(r"failed requests +(\d+) +(\d+) +\(simulated: refused by admission")


def _run(failed: int) -> MeasuredRun:
    figures = dict.fromkeys(METRICS) | {"median_ttft_ms": 100.0}
    return MeasuredRun("r.json", "collocated", (TraceRequest(0, 5, 2),), figures, 1, failed)


@pytest.mark.parametrize(("measured", "simulated", "row"), [
    (0, 0, None), (2, 0, ("2", "0")), (0, 3, ("0", "3")), (1, 4, ("1", "4"))])
def test_the_row_shows_when_either_side_failed(measured, simulated, row):
    c = compare(_run(measured), "colloc 1",
                dict.fromkeys(METRICS) | {"median_ttft_ms": 90.0, "failed": simulated})
    assert c.failed == simulated
    found = ROW.search(render_comparison(c))
    assert (found.groups() if found else None) == row
    out = comparison_json(c)
    assert out["failed_requests"] == {"measured": measured, "simulated": simulated}
    assert (out["completed"], out["failed"]) == (1, measured)  # the measured run's, as before


def test_a_simulated_summary_without_a_count_refused_none():
    assert compare(_run(0), "x", dict.fromkeys(METRICS)).failed == 0


@pytest.fixture
def files(tmp_path):
    """Steps to calibrate on; a collocated run of three requests sent at once, one failed."""
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    burst = [request(0.0, 1000, 11), request(0.0, 1000, 11), request(0.0, 1000, 11, ok=False)]
    results = write_json(tmp_path / "b.json", {"collocated": serve_result(burst)})
    return steps, results


def simulate(capsys, files, *args: str) -> tuple[int, str, str]:
    steps, results = files
    return run_pdserve(["simulate", "--model", "smollm2-135m", "--gpu", "cpu", "--calibrate",
                        f"{steps}:disagg", "--compare-measured", f"{results}:collocated",
                        *args], capsys)


def test_the_cli_sets_the_simulations_refusals_beside_the_measured_failures(files, capsys):
    """One worker taking one request, no queue: the two others are refused (429) at once."""
    cap = ["--max-inflight-per-worker", "1", "--max-queue", "0"]
    rc, out, err = simulate(capsys, files, *cap)
    assert rc == 0, err
    assert ROW.search(out).groups() == ("1", "2")
    rc, out, err = simulate(capsys, files, *cap, "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["measured"]["failed_requests"] == {"measured": 1, "simulated": 2}
    assert data["results"][0]["failed"] == 2
    rc, out, _ = simulate(capsys, files, "--json")  # the router's defaults: room for all
    assert json.loads(out)["measured"]["failed_requests"] == {"measured": 1, "simulated": 0}
