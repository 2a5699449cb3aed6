"""The serving simulator: step costs against the planner, worker rules, head-of-line blocking,
KV admission, metrics, the CLI and bad input."""

from __future__ import annotations

import itertools
import json
import re
import time

import numpy as np
import pytest

from pdserve.planner.cost import Efficiency, decode_step_time, prefill_time
from pdserve.planner.hardware import get_hardware
from pdserve.planner.kv_math import kv_bytes_per_token_per_rank
from pdserve.planner.model_shape import load_model_shape
from pdserve.planner.simulate.calibration import Chunk, RooflineCosts
from pdserve.planner.simulate.cluster import Cluster, Layout
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.metrics import (
    ItlSamples,
    RequestRecord,
    Slo,
    _weighted_stats,
    stats,
    summarize,
)
from pdserve.planner.simulate.trace import TraceRequest, generate_trace, make_workload
from tests.planner.cli_run import run_pdserve

H100 = get_hardware("H100")
EFF = Efficiency()
TP = 8


def costs_for(model: str = "llama-3.1-70b", tp: int = TP) -> RooflineCosts:
    shape = load_model_shape(model)
    return RooflineCosts(shape, H100, tp, kv_bytes_per_token_per_rank(shape, "bf16", tp), EFF)


COSTS = costs_for()
KV = COSTS.kv_bytes_per_token_rank


def cluster(**kw) -> Cluster:
    base = {"kv_capacity_tokens": 1_000_000, "kv_bytes_per_token_rank": KV, "link_gbps": 100.0,
            "collocated_workers": 1}
    return Cluster(**(base | kw))


def gaps(record: RequestRecord) -> list[float]:
    t = record.token_times
    return [b - a for a, b in itertools.pairwise(t)]


def decode_s(batch: int, context_sum: int) -> float:
    return decode_step_time(COSTS.shape, H100, batch, context_sum / batch, KV, TP, EFF).seconds


# ---- step costs are the planner's --------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama-3.1-70b", "deepseek-v3"])
def test_whole_steps_equal_the_planner_cost_models(model):
    c = costs_for(model)
    pf = prefill_time(c.shape, H100, 3000, c.kv_bytes_per_token_rank, TP, EFF, prompts=2)
    assert c.step_seconds([Chunk(0, 3000, True)] * 2, 0, 0) == pytest.approx(pf.seconds, 1e-12)
    dc = decode_step_time(c.shape, H100, 16, 1000.0, c.kv_bytes_per_token_rank, TP, EFF)
    assert c.step_seconds((), 16, 16_000) == pytest.approx(dc.seconds, rel=1e-12)


def test_a_chunk_attends_over_its_prefix():
    whole = COSTS.step_seconds([Chunk(0, 8000, True)], 0, 0)
    first = COSTS.step_seconds([Chunk(0, 4000, False)], 0, 0)
    second = COSTS.step_seconds([Chunk(4000, 4000, True)], 0, 0)
    assert second > first  # the same tokens, but 4000 more keys each
    assert first + second == pytest.approx(whole, rel=1e-9)  # compute-bound: FLOPs add up


# ---- one request ---------------------------------------------------------------------------------


def test_one_request_disaggregated_ttft_is_prefill_and_itl_is_the_decode_step():
    trace = [TraceRequest(0.0, 4000, 6)]
    r = simulate("disagg", cluster(), COSTS, trace, trace_tokens=True).records[0]
    prefill = prefill_time(COSTS.shape, H100, 4000, KV, TP, EFF).seconds
    assert r.ttft_s == pytest.approx(prefill, rel=1e-12)
    transfer = cluster().transfer_seconds(4000)
    assert transfer == pytest.approx(4000 * KV * 8 / 100e9)
    expected = [transfer + decode_s(1, 4001)] + [decode_s(1, 4000 + k) for k in range(2, 6)]
    assert gaps(r) == pytest.approx(expected, rel=1e-12)
    assert r.e2el_s == pytest.approx(prefill + sum(expected), rel=1e-12)
    assert r.tpot_s == pytest.approx(sum(expected) / 5, rel=1e-12)


def test_a_fixed_hand_over_cost_delays_a_split_requests_second_token_only():
    """--link-fixed-ms: every hand-over costs its fixed part before the wire time; token 0
    (the prefill worker's) and the later gaps do not move."""
    trace = [TraceRequest(0.0, 4000, 6)]
    plain = simulate("disagg", cluster(), COSTS, trace, trace_tokens=True).records[0]
    slow = simulate("disagg", cluster(link_fixed_s=0.08), COSTS, trace,
                    trace_tokens=True).records[0]
    assert cluster(link_fixed_s=0.08).transfer_seconds(4000) == pytest.approx(
        0.08 + 4000 * KV * 8 / 100e9)
    assert slow.ttft_s == plain.ttft_s
    assert gaps(slow)[0] == pytest.approx(gaps(plain)[0] + 0.08, rel=1e-12)
    assert gaps(slow)[1:] == pytest.approx(gaps(plain)[1:], rel=1e-12)


@pytest.mark.parametrize("layout", ["colloc", "chunked"])
def test_one_request_collocated_has_no_transfer(layout):
    r = simulate(layout, cluster(chunk_tokens=8192), COSTS, [TraceRequest(1.0, 4000, 4)],
                 trace_tokens=True).records[0]
    assert r.ttft_s == pytest.approx(prefill_time(COSTS.shape, H100, 4000, KV, TP, EFF).seconds,
                                     rel=1e-12)
    assert gaps(r) == pytest.approx([decode_s(1, 4000 + k) for k in (1, 2, 3)], rel=1e-12)


def test_one_output_token_ends_at_prefill():
    for layout in Layout:
        r = simulate(layout, cluster(), COSTS, [TraceRequest(0.0, 500, 1)]).records[0]
        assert r.e2el_s == r.ttft_s and r.tpot_s is None


# ---- head-of-line blocking -----------------------------------------------------------------------

HOL_TRACE = [TraceRequest(0.0, 100, 200), TraceRequest(0.2, 8000, 2)]


def test_collocated_itl_spikes_by_the_prefill_time_disaggregated_stays_flat():
    prefill_b = COSTS.step_seconds([Chunk(0, 8000, True)], 0, 0)
    colloc = simulate("colloc", cluster(), COSTS, HOL_TRACE, trace_tokens=True).records[0]
    g = gaps(colloc)
    k = int(np.argmax(g)) + 1  # A's token that came out of the step with B's whole prompt
    # one mixed step, as pdserve's engine runs it: B's prompt beside A's decode (context 100 + k)
    spike = COSTS.step_seconds([Chunk(0, 8000, True)], 1, 100 + k)
    assert g[k - 1] == pytest.approx(spike, rel=1e-9)
    assert g[k - 1] >= prefill_b

    disagg = simulate("disagg", cluster(), COSTS, HOL_TRACE, trace_tokens=True).records[0]
    steady = gaps(disagg)[1:]  # gap 0 (token 0 -> 1) holds A's own KV transfer
    assert max(steady) <= decode_s(2, 300 + 8002) * (1 + 1e-12)
    assert max(steady) < 1.1 * min(steady) < prefill_b / 10


def test_chunked_prefill_bounds_the_spike_to_one_chunk():
    chunked = simulate("chunked", cluster(chunk_tokens=512), COSTS, HOL_TRACE,
                       trace_tokens=True).records[0]
    worst_chunk = COSTS.step_seconds([Chunk(7488, 512, True)], 1, 400)
    assert max(gaps(chunked)) <= worst_chunk * 1.01
    assert max(gaps(chunked)) < COSTS.step_seconds([Chunk(0, 8000, True)], 0, 0) / 5


def test_chunked_steps_continue_partial_prompts_first():
    trace = [TraceRequest(0.0, 700, 3)] * 3
    recs = simulate("chunked", cluster(chunk_tokens=512), COSTS, trace).records
    s1 = COSTS.step_seconds([Chunk(0, 512, False)], 0, 0)
    s2 = COSTS.step_seconds([Chunk(512, 188, True), Chunk(0, 324, False)], 0, 0)
    # the budget counts the decode token too (pdserve's max_num_batched_tokens): 511 prompt ones
    s3 = COSTS.step_seconds([Chunk(324, 376, True), Chunk(0, 135, False)], 1, 701)
    assert recs[0].ttft_s == pytest.approx(s1 + s2, rel=1e-12)
    assert recs[1].ttft_s == pytest.approx(s1 + s2 + s3, rel=1e-12)
    assert all(r.finish_s is not None for r in recs)


# ---- batching, admission, routing ----------------------------------------------------------------


def test_prefill_budget_packs_prompts_into_one_step():
    trace = [TraceRequest(0.0, 1000, 2)] * 2
    packed = simulate("disagg", cluster(), COSTS, trace).records
    both = COSTS.step_seconds([Chunk(0, 1000, True)] * 2, 0, 0)
    assert [r.ttft_s for r in packed] == pytest.approx([both, both], rel=1e-12)
    one = COSTS.step_seconds([Chunk(0, 1000, True)], 0, 0)
    split = simulate("disagg", cluster(prefill_budget_tokens=1500), COSTS, trace).records
    assert [r.ttft_s for r in split] == pytest.approx([one, 2 * one], rel=1e-12)
    parallel = simulate("disagg", cluster(prefill_workers=2), COSTS, trace).records
    assert [r.ttft_s for r in parallel] == pytest.approx([one, one], rel=1e-12)


def test_decode_queues_when_kv_memory_is_full():
    trace = [TraceRequest(0.0, 1000, 50)] * 3
    recs = simulate("disagg", cluster(kv_capacity_tokens=2 * 1050), COSTS, trace,
                    trace_tokens=True).records
    first_done = min(recs[0].finish_s, recs[1].finish_s)
    assert recs[2].token_times[1] > first_done  # admitted only once KV was freed
    assert recs[2].token_times[1] == pytest.approx(first_done + decode_s(1, 1001), rel=1e-12)
    roomy = simulate("disagg", cluster(), COSTS, trace, trace_tokens=True).records
    assert roomy[2].token_times[1] < first_done


def test_max_batch_limits_running_requests():
    trace = [TraceRequest(0.0, 100, 20)] * 2
    recs = simulate("colloc", cluster(max_batch=1), COSTS, trace).records
    assert recs[1].first_token_s >= recs[0].finish_s


def test_same_trace_same_records():
    trace = generate_trace(make_workload("mixed", 20), seed=2, duration_s=20)
    for layout in Layout:
        a = simulate(layout, cluster(collocated_workers=2), COSTS, trace)
        b = simulate(layout, cluster(collocated_workers=2), COSTS, trace)
        assert a.records == b.records and a.itl == b.itl


def test_simulation_time_grows_linearly_with_the_trace():
    # ten times the requests may take at most 30 times as long (a quadratic step would take
    # 100): a ratio measured in one run, not a time, so a slow or busy machine does not fail it
    def seconds(duration_s: float) -> tuple[float, int]:
        trace = generate_trace(make_workload("chat", 10), seed=0, duration_s=duration_s)
        t0 = time.perf_counter()
        result = simulate("disagg", cluster(prefill_workers=2, decode_workers=4), COSTS, trace)
        assert all(r.finish_s is not None for r in result.records)
        return time.perf_counter() - t0, len(trace)

    short, n_short = seconds(60)
    long, n_long = seconds(600)
    assert n_long > 9 * n_short and n_long > 5900
    assert long < 30 * short


# ---- metrics -------------------------------------------------------------------------------------


def test_run_length_itl_equals_the_per_token_itl():
    trace = generate_trace(make_workload("chat", 30), seed=1, duration_s=10)
    result = simulate("colloc", cluster(collocated_workers=2), COSTS, trace, trace_tokens=True)
    every = [g for r in result.records for g in gaps(r)]
    assert result.itl.total == len(every)
    assert _weighted_stats(result.itl.values, result.itl.counts) == pytest.approx(stats(every))


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    values, counts = rng.exponential(size=200), rng.integers(1, 9, size=200)
    got = _weighted_stats(list(values), list(counts))
    flat = np.repeat(values, counts)
    assert got.mean_ms == pytest.approx(flat.mean() * 1e3)
    assert [got.median_ms, got.p90_ms, got.p99_ms] == pytest.approx(
        list(np.percentile(flat, [50, 90, 99]) * 1e3))
    assert stats([]) is None


def _record(i: int, ttft: float, e2el: float, out: int) -> RequestRecord:
    return RequestRecord(i, 1.0, 100, out, first_token_s=1.0 + ttft, finish_s=1.0 + e2el)


def test_goodput_counts_requests_meeting_both_slos():
    recs = [_record(0, 0.1, 1.1, 11),  # TTFT 100 ms, TPOT 100 ms: good
            _record(1, 0.5, 1.5, 11),  # TTFT 500 ms: misses TTFT
            _record(2, 0.1, 3.1, 11),  # TPOT 300 ms: misses TPOT
            _record(3, 0.2, 0.2, 1)]  # one token: no TPOT, TTFT ok: good
    s = summarize(recs, ItlSamples(), Slo(ttft_ms=400, tpot_ms=150))
    assert s.good_requests == 2 and s.completed == 4
    assert s.duration_s == pytest.approx(3.1)
    assert s.request_goodput == pytest.approx(2 / 3.1)
    assert summarize(recs, ItlSamples(), Slo()).good_requests == 4
    assert s.tpot.mean_ms == pytest.approx(1e3 * (0.1 + 0.1 + 0.3) / 3)
    assert s.itl is None


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "message"), [
    ({"prefill_workers": 0}, r"prefill_workers \(--prefill\) must be a positive integer"),
    ({"chunk_tokens": -1}, r"chunk_tokens \(--chunk\)"),
    ({"max_batch": 1.5}, r"max_batch \(--max-batch\)"),
    ({"link_gbps": 0}, r"link_gbps \(--link-gbps\)"),
    ({"split": "both"}, r"split must be one of remote, local, measured, got 'both'"),
    ({"tpot_target_s": 0}, r"tpot_target_s \(--slo-tpot-ms\) must be a positive number"),
    ({"tpot_target_s": float("nan")}, r"tpot_target_s \(--slo-tpot-ms\)"),
    ({"tpot_target_s": 0.1, "itl_target_s": 0.05},
     r"itl_target_s \(--slo-itl-ms\) must be at least tpot_target_s \(0.1 s\), got 0.05"),
    ({"itl_target_s": True}, r"itl_target_s \(--slo-itl-ms\)"),
    ({"link_fixed_s": -0.01}, r"link_fixed_s \(--link-fixed-ms\) must be a number of seconds"),
    ({"link_fixed_s": float("inf")}, r"link_fixed_s \(--link-fixed-ms\)"),
])
def test_bad_cluster_fields_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        cluster(**kw)


def test_bad_simulation_inputs_raise():
    with pytest.raises(ValueError, match=r"request 1 needs 5,000 tokens of KV"):
        simulate("disagg", cluster(kv_capacity_tokens=4000), COSTS,
                 [TraceRequest(0, 10, 10), TraceRequest(0, 4000, 1000)])
    with pytest.raises(ValueError, match="no requests"):
        simulate("disagg", cluster(), COSTS, [])
    with pytest.raises(ValueError, match="not a valid Layout"):
        simulate("both", cluster(), COSTS, [TraceRequest(0, 10, 10)])
    with pytest.raises(ValueError, match=r"slo_ttft_ms \(--slo-ttft-ms\)"):
        Slo(ttft_ms=-1)


# ---- the CLI -------------------------------------------------------------------------------------


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_pdserve(["simulate", *argv], capsys)


BIG = ["--model", "llama-3.1-70b", "--gpu", "H100", "--tp", "8", "--prefill", "4", "--decode",
       "4", "--workload", "rag", "--rate", "2", "--duration-s", "30"]


def test_cli_text_compares_the_three_layouts(capsys):
    rc, out, err = run_cli(BIG, capsys)
    assert rc == 0 and err == ""
    for text in ("disagg 4P+4D", "colloc 8", "chunked 8 (2048)", "p99 ITL (ms)",
                 "median TTFT (ms)", "goodput (req/s)", "roofline (MFU 0.5, MBU 0.8)"):
        assert text in out


def test_cli_json_uses_vllm_metric_names(capsys):
    rc, out, _ = run_cli([*BIG, "--json", "--layouts", "disagg,chunked"], capsys)
    got = json.loads(out)
    assert rc == 0 and [r["layout"] for r in got["results"]] == ["disagg", "chunked"]
    keys = {f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99")
            for m in ("ttft", "tpot", "itl", "e2el")}
    keys |= {"completed", "request_throughput", "output_throughput", "request_goodput"}
    for result in got["results"]:
        assert keys <= result.keys() and result["completed"] == got["requests"]


def test_cli_reads_a_trace_file(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 4000, "output_tokens": 3}\n')
    rc, out, _ = run_cli(["--model", "llama-3.1-70b", "--tp", "8", "--trace", str(path),
                          "--json", "--layouts", "colloc"], capsys)
    got = json.loads(out)["results"][0]
    prefill = prefill_time(COSTS.shape, H100, 4000, KV, TP, EFF).seconds
    assert rc == 0 and got["mean_ttft_ms"] == pytest.approx(prefill * 1e3)


@pytest.mark.parametrize(("extra", "message"), [
    (["--rate", "0"], r"rate \(--rate\)"),
    (["--layouts", "disagg,both"], r"layouts \(--layouts\)"),
    (["--num-requests", "5"], "exactly one of duration_s"),
    (["--kv-capacity-tokens", "100"], "tokens of KV"),
    (["--prefill", "0"], r"prefill_workers \(--prefill\)"),
    (["--gpu", "TPU"], r"gpu \(--gpu\)"),
    (["--tp", "3"], r"cannot split 8 KV heads"),
    (["--tp", "1"], "leave no KV room"),
    (["--kv-dtype", "int3"], r"kv_dtype \(--kv-dtype\)"),
    (["--trace", "x.jsonl"], "give --trace or --workload"),
    (["--prompt-tokens", "5"], "go with --workload fixed"),
    (["--mfu", "2"], r"mfu \(--mfu\)"),
    (["--write-profile", "p.json"], "--write-profile needs --calibrate"),
])
def test_cli_bad_input_is_a_clean_error(capsys, extra, message):
    rc, out, err = run_cli([*BIG, *extra], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("pdserve: error: ")
    assert re.search(message, err)


def test_cli_help_renders(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["--help"], capsys)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--calibrate FILE" in out and "90% of device" in out


def test_cli_needs_a_model(capsys):
    rc, _, err = run_cli(["--workload", "chat"], capsys)
    assert rc == 2 and "model (--model) is required" in err


def test_a_closed_loop_sends_each_request_when_a_client_is_free():
    """Two clients, four requests recorded at t = 0, 0, 5, 5 (their sends in the measured
    run): replayed closed, the third goes when the first ends, the fourth when the second
    does, whatever their recorded times; open, at those times."""
    trace = [TraceRequest(0.0, 400, 3), TraceRequest(0.0, 400, 5), TraceRequest(5.0, 400, 3),
             TraceRequest(5.0, 400, 3)]
    closed = simulate("colloc", cluster(), COSTS, trace, clients=2).records
    assert closed[2].arrival_s == closed[0].finish_s
    assert closed[3].arrival_s == closed[1].finish_s
    assert closed[3].finish_s < 5.0
    opened = simulate("colloc", cluster(), COSTS, trace).records
    assert [r.arrival_s for r in opened] == [0.0, 0.0, 5.0, 5.0]
