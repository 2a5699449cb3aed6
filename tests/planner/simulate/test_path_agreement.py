"""A split layout's paths request by request: the router's route header kept by bench serve,
against the simulation's router, matched by place in the trace."""

from __future__ import annotations

import json

import pytest

from pdserve.planner.simulate.measured_run import load_measured_run
from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.path_agreement import PathAgreement, agreement, route_is_local
from tests.planner.cli_run import run_pdserve
from tests.planner.simulate.step_files import disagg_workers, request, serve_result, write_json

LOCAL, SPLIT = "local; rule=unmeasured", "disaggregated; rule=measured_cost"


def routed(start_s: float, prompt: int, route: str | None) -> dict:
    return request(start_s, prompt, 11) | {"route": route}


@pytest.mark.parametrize(("header", "local"), [
    (LOCAL, True), (SPLIT, False), ("local", True), (" disaggregated ;rule=threshold", False),
    ("collocated; rule=x", None), ("", None), (None, None), (3, None)])
def test_the_route_header_gives_the_path(header, local):
    assert route_is_local(header) is local


def records(*paths: bool | None) -> list[RequestRecord]:
    return [RequestRecord(i, float(i), 100 * (i + 1), 5, local=p) for i, p in enumerate(paths)]


def test_requests_are_matched_by_place_and_counted_only_where_both_know():
    measured = [True, True, False, None, False, True]
    simulated = records(True, False, False, True, True, None)
    got = agreement(measured, simulated)
    assert got == PathAgreement(same=2, local_measured_only=(200,),
                                local_simulated_only=(500,))
    assert got.compared == 4
    assert got.describe() == ("2 of 4 requests on the same path; local measured, split "
                              "simulated: 1 (prompts of 200 tokens); split measured, local "
                              "simulated: 1 (prompts of 500 tokens)")
    assert agreement([True, False], records(True, False)).describe() == (
        "2 of 2 requests on the same path; local measured, split simulated: 0; split measured, "
        "local simulated: 0")


def test_another_trace_or_no_common_path_gives_nothing():
    assert agreement([True, False], records(True)) is None
    assert agreement([None, True], records(False, None)) is None


def test_a_run_keeps_its_paths_in_trace_order(tmp_path):
    rows = [routed(2.0, 300, SPLIT), routed(0.5, 100, LOCAL), routed(1.0, 200, None)]
    path = write_json(tmp_path / "r.json", serve_result(rows))
    run = load_measured_run(str(path), "x")
    assert [r.prompt_tokens for r in run.trace] == [100, 200, 300]
    assert run.paths == (True, None, False)
    plain = write_json(tmp_path / "p.json", serve_result([request(0.0, 100, 5)]))
    assert load_measured_run(str(plain), "x").paths == ()


def test_the_disagg_comparison_counts_the_paths_the_two_routers_took(tmp_path, capsys):
    """Both prompts arrive before any rate is reported: the simulated router's unmeasured rule
    splits the 1,000-token one and keeps the 16-token one local; the measured router split
    both."""
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    rows = [routed(0.0, 1000, "disaggregated; rule=unmeasured"),
            routed(0.001, 16, "disaggregated; rule=unmeasured")]
    whole = [routed(0.0, 1000, "local; rule=collocated_worker")]
    results = write_json(tmp_path / "b.json", {"disagg": serve_result(rows),
                                                "collocated": serve_result(whole)})
    args = ["simulate", "--model", "smollm2-135m", "--gpu", "cpu", "--calibrate",
            f"{steps}:disagg", "--compare-measured", f"{results}:disagg"]
    rc, out, err = run_pdserve([*args, "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["measured"]["paths"] == {
        "same": 1, "compared": 2, "local_measured_only": [], "local_simulated_only": [16]}
    rc, out, _ = run_pdserve(args, capsys)
    assert rc == 0 and ("paths: 1 of 2 requests on the same path; local measured, split "
                        "simulated: 0; split measured, local simulated: 1 (prompts of 16 "
                        "tokens)") in out
    rc, out, _ = run_pdserve([*args[:-1], f"{results}:collocated", "--json"], capsys)
    assert rc == 0 and "paths" not in json.loads(out)["measured"]  # no split layout
