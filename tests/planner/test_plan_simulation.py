"""`pdserve plan --rate/--concurrency`: the verdict from simulated layouts of the same hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.planner.hardware import get_hardware
from pdserve.planner.plan import Verdict
from pdserve.planner.plan_simulation import PLAN_REQUESTS, LayoutResult, Load, judge
from pdserve.planner.simulate.events import Layout
from pdserve.planner.simulate.metrics import Slo
from tests.planner.cli_run import run_pdserve
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

LONG = ["plan", "--model", "smollm2-135m", "--gpu", "cpu", "--prompt-tokens", "1750",
        "--output-tokens", "56", "--link-gbps", "20"]


def plan_json(argv: list[str], capsys) -> dict:
    rc, out, err = run_pdserve([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


def test_long_prompts_on_two_cores_collocate_where_the_rules_say_disaggregate(capsys):
    rules = plan_json(LONG, capsys)
    assert rules["verdict"] == "disaggregate" and "simulation" not in rules
    sim = plan_json([*LONG, "--rate", "0.4"], capsys)
    assert sim["verdict"] == "collocate" and sim["verdict_from"] == "simulation"
    layouts = {x["label"]: x for x in sim["simulation"]["layouts"]}
    assert list(layouts) == ["colloc 1 (2 cores)", "chunked 1 (2 cores)",
                             "disagg 1P+1D (1 of 2 cores each)"]
    # a 1,750-token prompt on one core takes twice its time on two: past the 2 s TTFT bound
    split, colloc = layouts["disagg 1P+1D (1 of 2 cores each)"], layouts["colloc 1 (2 cores)"]
    assert split["median_ttft_ms"] == pytest.approx(2 * colloc["median_ttft_ms"], rel=0.05)
    assert split["request_goodput"] < colloc["request_goodput"]
    assert all(x["completed"] == PLAN_REQUESTS for x in layouts.values())
    assert any("rules of thumb say disaggregate" in n for n in sim["notes"])


def test_very_long_prompts_on_gpus_disaggregate_and_the_table_names_every_split(capsys):
    argv = ["plan", "--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "8", "--prompt-tokens",
            "32768", "--output-tokens", "512", "--link-gbps", "400", "--rate", "1",
            "--slo-tpot-ms", "50", "--workers", "4"]
    rc, out, err = run_pdserve(argv, capsys)
    assert rc == 0, err
    for label in ("colloc 4", "chunked 4", "disagg 1P+3D", "disagg 2P+2D", "disagg 3P+1D"):
        assert f"\n    {label} " in out
    assert "verdict        DISAGGREGATE: simulated" in out
    assert out.index("simulated      200 requests, Poisson 1 req/s") < out.index("verdict")


def _steps_file(tmp_path: Path, colloc_scale: float, split_scale: float,
                chunked: bool = False) -> Path:
    """A bench compare .steps.json whose configurations ran on machines `scale` times slower
    than step_files' linear one."""
    def worker(k: float) -> list[list[float]]:
        return (context_decode_steps(D0 * k, D1 * k, C1 * k)
                + attention_prefill_steps(P0 * k, P1 * k, PA * k))
    data = {"collocated": {"colloc-0": worker(colloc_scale)},
            "disagg": {"prefill-0": worker(split_scale), "decode-0": worker(split_scale)}}
    if chunked:
        data["collocated-chunked"] = {"colloc-0": worker(colloc_scale)}
    path = tmp_path / "cmp.steps.json"
    path.write_text(json.dumps(data))
    return path


def test_each_configuration_is_priced_by_its_own_steps(tmp_path, capsys):
    slow_split = _steps_file(tmp_path, colloc_scale=1, split_scale=8)
    got = plan_json([*LONG, "--rate", "0.4", "--calibrate", str(slow_split)], capsys)
    assert [x["label"] for x in got["simulation"]["layouts"]] == ["collocated", "disagg"]
    assert got["verdict"] == "collocate"
    assert any("did not run collocated-chunked" in n for n in got["notes"])
    assert got["simulation"]["costs"].startswith("fitted per configuration")
    slow_colloc = _steps_file(tmp_path, colloc_scale=8, split_scale=1, chunked=True)
    got = plan_json([*LONG, "--rate", "0.4", "--calibrate", str(slow_colloc)], capsys)
    assert got["verdict"] == "disaggregate"
    assert len(got["simulation"]["layouts"]) == 3


def test_configurations_on_the_same_threads_are_fitted_on_their_steps_pooled(tmp_path, capsys):
    """With the results beside the steps, collocated and chunked (one worker on 2 threads,
    the same reference job) are each fitted on both runs' steps; disagg (1 thread) alone."""
    steps = _steps_file(tmp_path, colloc_scale=1, split_scale=8, chunked=True)
    ref = {"threads": 2, "prefill_tokens": 512, "prefill_s": [0.3]}
    write_json(tmp_path / "cmp.json", {
        "collocated": {"speed_reference": ref}, "collocated-chunked": {"speed_reference": ref},
        "disagg": {"speed_reference": {**ref, "threads": 1}}})
    got = plan_json([*LONG, "--rate", "0.4", "--calibrate", str(steps)], capsys)
    assert [n for n in got["notes"] if "fitted on the steps of" in n] == [
        "collocated fitted on the steps of collocated+collocated-chunked",
        "collocated-chunked fitted on the steps of collocated-chunked+collocated"]


def test_a_run_beside_the_steps_prices_its_front_end_and_moves_the_ttft(tmp_path, capsys):
    """cmp.json beside cmp.steps.json: its collocated run's one request measured a TTFT 60 ms
    over what its steps give, so the plan's collocated TTFTs grow by that round trip."""
    steps = _steps_file(tmp_path, colloc_scale=1, split_scale=8)
    before = plan_json([*LONG, "--rate", "0.4", "--calibrate", str(steps)], capsys)
    one = serve_result([request(0.0, 1750, 56, ttft_s=(_prefill_ms(1750) + 60.0) / 1e3)])
    write_json(tmp_path / "cmp.json", {"collocated": one})
    after = plan_json([*LONG, "--rate", "0.4", "--calibrate", str(steps)], capsys)
    assert f"front-end round trip 60.0 ms, fitted to the 10th-percentile TTFT of " \
           f"{tmp_path / 'cmp.json'}:collocated" in after["notes"]
    ttft = {side: {x["label"]: x["median_ttft_ms"] for x in got["simulation"]["layouts"]}
            for side, got in (("before", before), ("after", after))}
    assert ttft["after"]["collocated"] == pytest.approx(ttft["before"]["collocated"] + 60.0,
                                                        abs=1.5)
    assert ttft["after"]["disagg"] == ttft["before"]["disagg"]  # not in cmp.json: none


def _prefill_ms(n: int) -> float:
    """One whole prompt of n tokens on step_files' machine (its attention pairs included)."""
    return (P0 + P1 * n + PA * n * (n + 1) / 2) * 1e3

def test_concurrency_runs_a_closed_loop(capsys):
    argv = ["plan", "--model", "smollm2-135m", "--gpu", "cpu", "--prompt-tokens", "160",
            "--output-tokens", "96", "--link-gbps", "20", "--concurrency", "16"]
    got = plan_json(argv, capsys)
    assert got["simulation"]["concurrency"] == 16 and got["simulation"]["rate"] is None
    assert all(x["completed"] == PLAN_REQUESTS for x in got["simulation"]["layouts"])


@pytest.mark.parametrize("extra, message", [
    (["--rate", "1", "--concurrency", "4"], "exactly one of --rate and --concurrency"),
    (["--calibrate", "x.json"], "--calibrate prices a simulation: give --rate or --concurrency"),
    (["--rate", "0"], "rate (--rate) must be a positive number"),
    (["--rate", "1", "--workers", "1"], "workers (--workers) must be an integer >= 2"),
    (["--rate", "1", "--workers", "3"], "3 workers cannot share the 2 cores of cpu-epyc-2core"),
])
def test_bad_load_flags_are_refused(extra, message, capsys):
    rc, out, err = run_pdserve([*LONG, *extra], capsys)
    assert rc == 2 and out == ""
    assert message in err


def test_one_worker_profile_cannot_price_split_cores(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"schema": "pdserve.calibration-profile/1",
                                   "decode": {"overhead_s": 0.02, "per_seq_s": 0.001},
                                   "prefill": {"per_token_s": 0.001}}))
    rc, _, err = run_pdserve([*LONG, "--rate", "1", "--calibrate", str(profile)], capsys)
    assert rc == 2 and "cannot price layouts that split the cores" in err


def test_a_profile_prices_every_gpu_worker(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"schema": "pdserve.calibration-profile/1",
                                   "decode": {"overhead_s": 0.02, "per_seq_s": 0.001},
                                   "prefill": {"per_token_s": 0.001}}))
    argv = ["plan", "--model", "smollm2-135m", "--gpu", "h100", "--prompt-tokens", "1000",
            "--output-tokens", "50", "--link-gbps", "100", "--rate", "0.5", "--calibrate",
            str(profile)]
    got = plan_json(argv, capsys)
    colloc = got["simulation"]["layouts"][0]
    # 1,000 tokens at 1 ms each, alone on an idle worker: the first arrival's TTFT is 1 s
    assert colloc["median_ttft_ms"] >= 1000
    assert got["simulation"]["costs"].startswith("calibrated")


def test_share_splits_a_cpu_machine_and_refuses_a_gpu():
    cpu = get_hardware("cpu")
    half = cpu.share(2)
    assert half.bf16_flops == cpu.bf16_flops / 2 and half.cores == 1
    assert half.memory_bandwidth == cpu.memory_bandwidth / 2
    assert cpu.share(1) is cpu
    with pytest.raises(ValueError, match="is a GPU"):
        get_hardware("h100").share(2)


def _result(label: str, layout: Layout, goodput: float) -> LayoutResult:
    return LayoutResult(label, layout, {"request_goodput": goodput, "output_throughput": 1.0,
                                        "median_ttft_ms": 1.0, "p99_itl_ms": 1.0}, 0)


@pytest.mark.parametrize("colloc, split, verdict", [
    (1.0, 1.04, Verdict.MARGINAL), (1.0, 1.06, Verdict.DISAGGREGATE),
    (1.06, 1.0, Verdict.COLLOCATE), (0.0, 0.0, Verdict.MARGINAL)])
def test_judge_needs_a_margin(colloc, split, verdict):
    got, reason = judge([_result("c", Layout.CHUNKED, colloc), _result("d", Layout.DISAGG,
                                                                        split)])
    assert got is verdict
    assert "d: goodput" in reason and "c: goodput" in reason


def test_load_validates():
    with pytest.raises(ValueError, match="needs both a TTFT and a TPOT bound"):
        Load(rate=1.0, concurrency=None, slo=Slo(ttft_ms=100.0))
