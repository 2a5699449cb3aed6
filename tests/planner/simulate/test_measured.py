"""Measured runs: bench serve/compare results as traces, the measured layout, and
`pdserve simulate --compare-measured` printing simulated figures beside measured ones, each
against its tolerance."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.bench.compare import CONFIGS
from pdserve.planner.simulate.cluster import Layout
from pdserve.planner.simulate.measured_compare import (
    MERGED,
    PDSERVE_CONFIGS,
    MeasuredLayout,
    compare,
    comparison_json,
    measured_layout,
    on_the_cliff,
    render_comparison,
)
from pdserve.planner.simulate.measured_run import (
    METRICS,
    MeasuredRun,
    load_measured_run,
    read_trace_file,
    served_merged,
)
from pdserve.planner.simulate.metrics import ItlSamples
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.cli_run import run_pdserve
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

FLAG = "compare_measured (--compare-measured)"
SERVE = serve_result([request(2.5, 300, 40), request(0.0, 100, 20),
                      request(1.0, 200, 0, ok=False)])


def test_a_serve_result_becomes_a_sorted_trace_of_every_request(tmp_path):
    run = load_measured_run(str(write_json(tmp_path / "r.json", SERVE)), FLAG)
    assert run.trace == (TraceRequest(0.0, 100, 20), TraceRequest(1.0, 200, 1),
                         TraceRequest(2.5, 300, 40))  # the failed one as a one-token request
    assert (run.completed, run.failed, run.config) == (2, 1, None)
    assert run.measured == {"median_ttft_ms": 100.0, "p99_ttft_ms": None,
                            "median_itl_ms": 20.0, "p99_itl_ms": 99.0, "request_goodput": None,
                            "output_throughput": None}  # what the file has


def test_a_closed_loop_run_says_how_many_clients_sent_it(tmp_path):
    assert load_measured_run(str(write_json(tmp_path / "o.json", SERVE)), FLAG).clients is None
    closed = write_json(tmp_path / "c.json", {**SERVE, "max_concurrency": 16})
    assert load_measured_run(str(closed), FLAG).clients == 16
    bad = write_json(tmp_path / "b.json", {**SERVE, "max_concurrency": 0})
    with pytest.raises(ValueError, match="max_concurrency must be a positive integer"):
        load_measured_run(str(bad), FLAG)


def test_compare_results_need_a_config_unless_they_hold_one(tmp_path):
    one = write_json(tmp_path / "one.json", {"disagg": SERVE})
    run = load_measured_run(str(one), FLAG)
    assert (run.config, run.label) == ("disagg", f"{one}:disagg")
    two = write_json(tmp_path / "two.json", {"disagg": SERVE, "collocated": SERVE})
    assert load_measured_run(f"{two}:collocated", FLAG).config == "collocated"
    with pytest.raises(ValueError, match=r"holds configurations 'disagg', 'collocated': "
                                         r"choose one as .*two.json:CONFIG"):
        load_measured_run(str(two), FLAG)
    with pytest.raises(ValueError, match=r"no configuration 'vllm' .*\(it has: 'disagg', "
                                         "'collocated'\\)"):
        load_measured_run(f"{two}:vllm", FLAG)
    with pytest.raises(ValueError, match="a bench serve result: it has no configurations"):
        load_measured_run(f"{write_json(tmp_path / 'r.json', SERVE)}:disagg", FLAG)


@pytest.mark.parametrize("data, message", [
    ({"median_ttft_ms": 1.0}, "is not a bench serve or compare results file"),
    ({"disagg": {"decode-0": []}}, "is not a bench serve or compare results file"),
    (serve_result([{"start_s": 0.0, "output_tokens": 3}]), "request 1: missing prompt_tokens"),
    (serve_result([request(0, 10, 2), request(-1.0, 10, 2)]), "request 2: arrival_s must be"),
    (serve_result([request(0, 0, 2)]), "request 1: prompt_tokens must be an integer >= 1"),
    (serve_result([]), "the run holds no requests"),
    (serve_result([request(0, 10, 2)], ttft_ms=-3.0), "median_ttft_ms must be a finite"),
])
def test_bad_results_files_say_what_is_wrong(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        load_measured_run(str(write_json(tmp_path / "r.json", data)), FLAG)


def test_trace_reads_results_files_and_still_jsonl(tmp_path):
    cmp = write_json(tmp_path / "cmp.json", {"disagg": SERVE, "collocated": SERVE})
    trace, label = read_trace_file(f"{cmp}:disagg")
    assert len(trace) == 3 and label == f"requests of {cmp}:disagg"
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n')
    assert read_trace_file(str(jsonl)) == ((TraceRequest(0, 5, 2),), f"file {jsonl}")
    with pytest.raises(ValueError, match="is a JSONL trace: it has no configurations"):
        read_trace_file(f"{jsonl}:disagg")


def run_of(config: str | None, ttft: float | None = 100.0, itl: float | None = 20.0):
    figures = dict.fromkeys(METRICS) | {"median_ttft_ms": ttft, "median_itl_ms": itl}
    return MeasuredRun("r.json", config, (TraceRequest(0, 5, 2),), figures, 1, 0)


def test_bench_compare_names_fix_the_layout_and_pdserve_limits():
    disagg = measured_layout(run_of("disagg"), None)
    assert (disagg.layout, disagg.prefill_workers, disagg.decode_workers) == (Layout.DISAGG, 1, 1)
    assert (disagg.max_batch, disagg.chunk_tokens, disagg.kv_cache_bytes) == (64, 512, 2**29)
    assert measured_layout(run_of("collocated"), (Layout.COLLOC,)).collocated_workers == 1
    assert PDSERVE_CONFIGS["collocated-chunked"].layout is Layout.CHUNKED
    two = measured_layout(run_of("collocated-2"), None)
    assert (two.layout, two.collocated_workers) == (Layout.COLLOC, 2)
    with pytest.raises(ValueError, match="'collocated' is colloc; drop --layouts"):
        measured_layout(run_of("collocated"), (Layout.CHUNKED,))


def test_every_static_configuration_of_bench_compare_is_known_to_the_simulator():
    """The elastic one changes its layout while it runs: simulated only while it stays merged."""
    assert set(PDSERVE_CONFIGS) == set(CONFIGS) - {"elastic"}


def elastic_result(*, flips: int = 0, loans: int = 1, prefill_busy_s: float = 0.0) -> dict:
    """bench compare's elastic figures: a prefill and a decode worker and what they did."""
    def worker(role: str, busy: float) -> dict:
        return {"roles": [{"role": role, "since": 0.0, "from": None}],
                "steps": {"busy_s": busy, "prompt_steps": int(busy > 0)}}
    return {"workers": {"prefill-0": worker("prefill", prefill_busy_s),
                        "decode-0": worker("decode", 40.0)},
            "role_flips": flips, "core_loans": loans}


def test_an_elastic_pair_that_stayed_merged_is_simulated_as_one_engine_prefilling_locally(
        tmp_path):
    assert served_merged(elastic_result())
    path = tmp_path / "cmp.json"
    write_json(path, {"elastic": serve_result([request(0.0, 100, 4)]) | elastic_result(),
                      "collocated": serve_result([request(0.0, 100, 4)])})
    merged = load_measured_run(f"{path}:elastic", "--compare-measured")
    assert merged.merged and not load_measured_run(f"{path}:collocated", "x").merged
    layout = measured_layout(merged, None)
    assert layout is MERGED
    assert (layout.layout, layout.prefill_workers, layout.decode_workers, layout.split) == \
        (Layout.DISAGG, 1, 1, SplitRule.LOCAL)
    assert measured_layout(merged, (Layout.DISAGG,)) is MERGED


@pytest.mark.parametrize("result", [
    elastic_result(flips=1),  # a role flipped
    elastic_result(loans=0),  # never lent: a split pair
    elastic_result(loans=2),  # lent, taken back, lent again
    elastic_result() | {"core_reclaims": 1},  # taken back
    elastic_result(prefill_busy_s=3.5),  # the prefill worker computed before the loan
    {"role_flips": 0, "core_loans": 1},  # a file that does not record its workers
    elastic_result() | {"split_decisions": {"local": 3, "remote": 1}},  # a prompt went remote
    elastic_result() | {"repeats": [{"role_flips": 0, "core_loans": 1},  # one round of two
                                    {"role_flips": 1, "core_loans": 1}]},  # flipped
])
def test_an_elastic_run_whose_layout_changed_is_not_simulated_as_merged(result):
    assert not served_merged(result)
    split = run_of("elastic")
    with pytest.raises(ValueError, match="its pair was not served merged throughout: a role "
                                         "flipped, the cores were taken back, or the "
                                         "prefill worker computed"):
        measured_layout(split, None)
    assert measured_layout(split, (Layout.DISAGG,)) == MeasuredLayout(Layout.DISAGG)


def test_other_runs_take_exactly_one_layout_from_flags():
    assert measured_layout(run_of("vllm"), (Layout.CHUNKED,)) == MeasuredLayout(Layout.CHUNKED)
    for run, layouts in ((run_of("vllm"), None), (run_of(None), tuple(Layout))):
        with pytest.raises(ValueError, match="pass --layouts with one of disagg, colloc"):
            measured_layout(run, layouts)


def _simulated(**figures: float) -> dict[str, float | None]:
    return dict.fromkeys(METRICS) | figures


def test_relative_errors_and_the_verdict():
    run = MeasuredRun("r.json", "disagg", (TraceRequest(0, 5, 2),),
                      _simulated(median_ttft_ms=100.0, median_itl_ms=20.0, p99_itl_ms=100.0,
                                 request_goodput=0.5), 1, 0)
    c = compare(run, "disagg 1P+1D", _simulated(median_ttft_ms=120.0, median_itl_ms=19.0,
                                                p99_itl_ms=130.0, request_goodput=0.55))
    assert c.error("median_ttft_ms") == pytest.approx(0.2)
    assert c.error("median_itl_ms") == pytest.approx(-0.05)
    assert c.error("request_goodput") == pytest.approx(0.1)
    assert c.worst == pytest.approx(0.3 / 0.35)  # the P99 ITL: 30% of its 35%
    text = render_comparison(c)
    assert re.search(r"median TTFT \(ms\) +100\.00 +120\.00 +\+20\.0%  \(within 25%\)", text)
    assert re.search(r"P99 ITL \(ms\) +100\.00 +130\.00 +\+30\.0%  \(within 35%\)", text)
    assert "goodput (req/s)" in text
    assert "every figure within its tolerance" in text and "NOT" not in text
    worse = compare(run, "x", _simulated(median_ttft_ms=130.0))
    assert worse.worst == pytest.approx(1.2)
    assert "largest |error| / tolerance 1.20: NOT every figure" in render_comparison(worse)
    none = compare(run_of(None, ttft=0.0, itl=None), "x", _simulated(median_ttft_ms=1.0,
                                                                     median_itl_ms=2.0))
    assert none.error("median_ttft_ms") is None and none.worst is None


def test_the_p99_itl_has_the_share_of_simulated_itls_above_the_measured_p99():
    """Simulated: 980 steady ITLs of 20 ms and 20 stalls of 1.5 s (2%). Measured P99 100 ms:
    2% of the simulated ITLs lie above it, within a factor two of 1% (the cliff); measured
    P99 2 s: none do (the model's miss)."""
    itl = ItlSamples([0.02, 1.5], [980, 20])
    for p99, share, side in ((100.0, 0.02, "within"), (2000.0, 0.0, "outside")):
        run = MeasuredRun("r.json", "collocated", (TraceRequest(0, 5, 2),),
                          _simulated(p99_itl_ms=p99), 1, 0)
        c = compare(run, "colloc 1", _simulated(p99_itl_ms=1500.0), itl=itl)
        assert c.itl_above_p99 == pytest.approx(share)
        assert on_the_cliff(c.itl_above_p99) is (side == "within")
        assert (f"simulated ITLs above the measured P99 ITL: {share:.2%} (measured: 1%; {side} "
                "0.5-2%") in render_comparison(c)
        assert comparison_json(c)["itl_above_p99"] == pytest.approx(share)
    assert ItlSamples().share_above(1.0) is None


# ---- the command line -------------------------------------------------------------------------

# One request of 1000 prompt tokens and 11 output tokens on the step_files machine: TTFT is its
# prefill step, P0 + P1 x 1000 = 210 ms; 9 of its 10 ITL gaps are decode steps at B = 1,
# D0 + D1 = 22 ms (the first also carries the KV transfer), so the median ITL is 22 ms.
SIM_TTFT_MS, SIM_ITL_MS = (P0 + P1 * 1000) * 1e3, (D0 + D1) * 1e3


@pytest.fixture
def files(tmp_path):
    steps = write_json(tmp_path / "a.steps.json", {"disagg": disagg_workers()})
    one = serve_result([request(0.0, 1000, 11)], ttft_ms=231.0, itl_ms=20.0)
    results = write_json(tmp_path / "b.json", {"disagg": one, "collocated": one})
    return steps, results


def simulate_cli(capsys, *args: str) -> tuple[int, str, str]:
    return run_pdserve(["simulate", "--model", "smollm2-135m", "--gpu", "cpu", *args], capsys)


def test_cli_calibrated_on_run_a_predicts_run_b(files, capsys):
    steps, results = files
    rc, out, err = simulate_cli(capsys, "--calibrate", f"{steps}:disagg",
                                "--compare-measured", f"{results}:disagg")
    assert rc == 0, err
    assert f"trace: requests of {results}:disagg, 1 requests" in out
    assert "max batch 64" in out and "KV 23,301 tokens" in out  # 512 MiB / 23,040 B
    assert f"measured run {results}:disagg (1 ok, 0 failed) vs simulated disagg 1P+1D" in out
    assert re.search(r"median TTFT \(ms\) +231\.00 +210\.00 +-9\.1%", out)
    assert re.search(r"median ITL \(ms\) +20\.00 +22\.00 +\+10\.0%", out)
    assert "(within 35%)" in out and "largest |error| / tolerance" in out


def test_cli_json_carries_the_comparison(files, capsys):
    steps, results = files
    rc, out, _ = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--compare-measured",
                              f"{results}:collocated", "--json")
    data = json.loads(out)
    assert rc == 0 and [r["label"] for r in data["results"]] == ["colloc 1"]
    compared = data["measured"]
    assert set(compared["measured"]) == set(compared["simulated"]) == set(METRICS)
    assert compared["measured"]["median_ttft_ms"] == 231.0
    assert compared["simulated"]["median_ttft_ms"] == pytest.approx(SIM_TTFT_MS)
    assert compared["rel_error"]["median_ttft_ms"] == pytest.approx(SIM_TTFT_MS / 231 - 1)
    assert compared["tolerance"]["p99_itl_ms"] == 0.35
    assert data["costs"]["model"] == "smollm2-135m" and data["costs"]["gpu"] == "cpu"


def test_cli_serve_result_takes_layout_and_workers_from_flags(files, tmp_path, capsys):
    steps, _ = files
    serve = write_json(tmp_path / "r.json", serve_result([request(0.0, 1000, 11)]))
    rc, out, _ = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--compare-measured",
                              str(serve), "--layouts", "chunked", "--collocated", "1")
    assert rc == 0 and "vs simulated chunked 1 (2048)" in out
    rc, _, err = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--compare-measured",
                              str(serve))
    assert rc == 2 and "a bench serve result does not say how it was served" in err


def test_goodput_counts_with_the_bounds_the_measured_run_counted(tmp_path, files, capsys):
    steps, _ = files
    one = serve_result([request(0.0, 1000, 11)], ttft_ms=231.0, itl_ms=20.0)
    run = write_json(tmp_path / "slo.json", {"disagg": one | {"slo_ttft_ms": 200.0,
                                                               "slo_tpot_ms": 50.0}})
    rc, out, err = simulate_cli(capsys, "--calibrate", f"{steps}:disagg",
                                "--compare-measured", f"{run}:disagg", "--json")
    assert rc == 0, err
    # the simulated TTFT, 210 ms, misses the run's 200 ms bound: no goodput
    assert json.loads(out)["slo"] == {"ttft_ms": 200.0, "tpot_ms": 50.0}
    assert json.loads(out)["measured"]["simulated"]["request_goodput"] == 0
    rc, _, err = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--compare-measured",
                              f"{run}:disagg", "--slo-ttft-ms", "2000")
    assert rc == 2
    assert (f"--slo-ttft-ms 2000 differs from the 200 ms that {run}:disagg counted its goodput "
            f"with") in err
    rc, out, _ = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--num-requests", "2",
                              "--json")
    assert rc == 0 and json.loads(out)["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 100.0}


def test_the_paced_steps_ceiling_is_the_measured_clusters_unless_a_flag_sets_it(
        tmp_path, files, capsys):
    steps, _ = files
    one = serve_result([request(0.0, 1000, 11)], ttft_ms=231.0, itl_ms=20.0)
    run = write_json(tmp_path / "itl.json", {"disagg": one | {"slo_itl_ms": 300.0}})
    for extra, ceiling in (((), 300.0), (("--slo-itl-ms", "250"), 250.0)):
        rc, out, err = simulate_cli(capsys, "--calibrate", f"{steps}:disagg",
                                    "--compare-measured", f"{run}:disagg", "--json", *extra)
        assert rc == 0, err
        assert json.loads(out)["itl_target_ms"] == ceiling
    rc, out, _ = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--num-requests", "2",
                              "--json")
    assert rc == 0 and json.loads(out)["itl_target_ms"] is None
    rc, _, err = simulate_cli(capsys, "--calibrate", f"{steps}:disagg", "--num-requests", "2",
                              "--slo-itl-ms", "50")
    assert rc == 2 and "itl_target_s (--slo-itl-ms) must be at least tpot_target_s" in err


def test_cli_steps_need_the_device_they_ran_on(files, capsys):
    steps, _ = files
    rc, _, err = run_pdserve(["simulate", "--model", "smollm2-135m", "--calibrate", str(steps),
                              "--num-requests", "2"], capsys)
    assert rc == 2 and "gpu (--gpu) is required with bench rows or worker steps" in err
