"""The simulator's prefix cache: a prompt whose shared prefix its worker holds computes only
the rest (whole blocks reused, attention over the prefix still paid), LRU eviction within the
KV capacity, the router's view of it, the `prefix` preset, and traces and results files with
and without the prefix fields."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence

import pytest

from pdserve.planner.simulate.calibration import Chunk
from pdserve.planner.simulate.cluster import Cluster, Layout, RoutePolicy
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.measured_run import load_measured_run, read_trace_file
from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.prefix_cache import PrefixCache, PrefixTable, RoutedPrefixes
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.trace import (
    PREFIX_COUNT,
    PREFIX_TOKENS,
    TraceRequest,
    generate_trace,
    make_workload,
    read_trace_jsonl,
)
from tests.planner.simulate.step_files import request, serve_result, write_json
from tests.planner.simulate.test_events import COSTS, cluster

PER_TOKEN_S = 0.001  # a prefill step: 1 ms per computed prompt token, nothing else
DECODE_S = 0.01  # a step with streams: 10 ms more
PREFIX, SUFFIX = 1000, 50  # 1000 = 62 blocks of 16 + 8 tokens
REUSED = PREFIX // 16 * 16  # 992


class LinearCosts:
    """Seconds = 1 ms per computed prompt token (+ 10 ms with decodes): a prompt's time says
    exactly how many of its tokens it computed."""

    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        return PER_TOKEN_S * sum(c.tokens for c in chunks) + (DECODE_S if decodes else 0.0)


LINEAR = LinearCosts()


def shared(arrival_s: float, prefix_id: int | None, suffix: int = SUFFIX, output: int = 2,
           prefix: int = PREFIX) -> TraceRequest:
    """A request of `prefix` shared tokens (prefix_id None: not marked shared) + `suffix`."""
    return TraceRequest(arrival_s, prefix + suffix, output, prefix_id,
                        0 if prefix_id is None else prefix)


def linear_cluster(**kw) -> Cluster:
    base = {"kv_capacity_tokens": 100_000, "kv_bytes_per_token_rank": 1000, "link_gbps": 1.0,
            "collocated_workers": 1}
    return Cluster(**(base | kw))


LAYOUTS = [(Layout.COLLOC, {}), (Layout.CHUNKED, {}), (Layout.DISAGG, {}),
           (Layout.DISAGG, {"split": SplitRule.LOCAL}),
           (Layout.DISAGG, {"split": SplitRule.MEASURED})]


@pytest.mark.parametrize(("layout", "kw"), LAYOUTS)
def test_a_cached_prefix_leaves_the_suffix_and_the_last_partial_block(layout, kw):
    trace = [shared(0.0, 7), shared(10.0, 7)]
    first, second = simulate(layout, linear_cluster(**kw), LINEAR, trace).records
    assert first.ttft_s == pytest.approx(PER_TOKEN_S * (PREFIX + SUFFIX))
    # the second computes its suffix and the prefix's 8 tokens past its last whole block
    assert second.ttft_s == pytest.approx(PER_TOKEN_S * (SUFFIX + PREFIX % 16))
    unmarked = [dataclasses.replace(r, prefix_id=None, prefix_tokens=0) for r in trace]
    again = simulate(layout, linear_cluster(**kw), LINEAR, unmarked).records[1]
    assert again.ttft_s == pytest.approx(PER_TOKEN_S * (PREFIX + SUFFIX))


def test_a_reused_prefix_still_pays_attention_over_it():
    seen: list[Chunk] = []

    class Recording(LinearCosts):
        def step_seconds(self, chunks, decodes, context_sum):
            seen.extend(chunks)
            return super().step_seconds(chunks, decodes, context_sum)

    simulate("colloc", linear_cluster(), Recording(), [shared(0.0, 1), shared(10.0, 1)])
    assert seen == [Chunk(0, PREFIX + SUFFIX, True),
                    Chunk(REUSED, PREFIX + SUFFIX - REUSED, True)]


def test_the_whole_prompt_kv_still_travels_to_the_decode_worker():
    c = linear_cluster()
    trace = [shared(0.0, 3), shared(10.0, 3, output=3)]
    second = simulate("disagg", c, LINEAR, trace, trace_tokens=True).records[1]
    t = second.token_times
    assert t[1] - t[0] == pytest.approx(c.transfer_seconds(PREFIX + SUFFIX) + DECODE_S)


def test_the_split_rule_weighs_the_tokens_each_worker_lacks_and_the_whole_prompts_kv():
    # W (100 tokens, under the threshold before any rate) prefills on the decode worker, which
    # then reports 1,000 tokens/s. A (1,050) stays local there too (the same rate on both
    # paths, a link to pay on one) and leaves prefix 7 on it; B (3,000 tokens) then prefills
    # there. C, of prefix 7, is 58 uncached tokens there, behind B's 3 s step, at 58 tokens a
    # step beside B's stream (853 tokens/s: 3.6 s); split, the prefill worker (which lacks the
    # prefix) computes all 1,050 and the whole prompt's KV takes 8.4 s on the link, as the
    # router prices it: C stays local, first token after B's step and its own 58 tokens beside
    # B's stream (13.068 s).
    c = linear_cluster(split=SplitRule.MEASURED, kv_bytes_per_token_rank=1_000_000)
    trace = [TraceRequest(0.0, 100, 2), shared(1.0, 7), TraceRequest(10.0, 3000, 2),
             shared(10.5, 7)]
    result = simulate("disagg", c, LINEAR, trace)
    assert result.local_prefills == 4 and result.busy["prefill"] == 0.0
    assert c.transfer_seconds(PREFIX + SUFFIX) == pytest.approx(8.4)
    assert result.records[3].ttft_s == pytest.approx(10.0 + 3.0 + 0.058 + DECODE_S - 10.5)


def test_prefixes_lower_the_median_ttft_of_the_prefix_preset():
    trace = generate_trace(make_workload("prefix", 2.0), seed=1, num_requests=60)
    plain = [dataclasses.replace(r, prefix_id=None, prefix_tokens=0) for r in trace]
    for layout in Layout:
        c = cluster(prefill_workers=1, decode_workers=1)
        cached = statistics.median(r.ttft_s for r in simulate(layout, c, COSTS, trace).records)
        full = statistics.median(r.ttft_s for r in simulate(layout, c, COSTS, plain).records)
        assert cached < 0.5 * full, layout


def test_prompts_of_one_prefix_in_one_step_both_compute_it():
    trace = [shared(0.0, 1, prefix=960), shared(0.0, 1, prefix=960)]  # 2 x 1010 tokens: one step
    both = simulate("colloc", linear_cluster(), LINEAR, trace)
    assert [r.ttft_s for r in both.records] == [pytest.approx(PER_TOKEN_S * 2020)] * 2


def test_whole_prompts_pack_by_their_uncached_tokens():
    # after the first, three prompts of 1,050 tokens arrive: 3,150 > PROMPT_PACK_TOKENS, but
    # two of them compute 58 tokens each, so all three share one step
    trace = [shared(0.0, 1), shared(10.0, 1), shared(10.0, 1), shared(10.0, None)]
    records = simulate("colloc", linear_cluster(), LINEAR, trace).records
    assert [r.ttft_s for r in records[1:]] == [pytest.approx(PER_TOKEN_S * (58 + 58 + 1050))] * 3


def test_least_recently_used_prefixes_leave_first():
    # room for two prefixes of 992 tokens (and any one request's KV)
    c = linear_cluster(kv_capacity_tokens=2500)

    def tokens_computed(ids: list[int]) -> list[int]:
        trace = [shared(10.0 * i, k) for i, k in enumerate(ids)]
        return [round(r.ttft_s / PER_TOKEN_S)
                for r in simulate("colloc", c, LINEAR, trace).records]

    full, hit = PREFIX + SUFFIX, SUFFIX + PREFIX % 16
    assert tokens_computed([0, 1, 0, 2, 0]) == [full, full, hit, full, hit]  # 1 left, not 0
    assert tokens_computed([0, 1, 2, 0]) == [full, full, full, full]  # 2 evicted 0


def test_the_cache_unit():
    trace = [shared(0, k) for k in range(3)] + [shared(0, 3, prefix=10),
                                                shared(0, 4, suffix=0, prefix=48)]
    table = PrefixTable(trace, 16)
    records = [RequestRecord(i, 0.0, r.prompt_tokens, 2) for i, r in enumerate(trace)]
    cache = PrefixCache(table, 2 * REUSED)
    assert cache.peek(records[0]) == 0
    for r in records[:2]:
        r.prefilled = REUSED - 1
        cache.computed(r)  # not yet its whole blocks
    assert cache.used == 0
    for r in records[:2]:
        r.prefilled = r.prompt_tokens
        cache.computed(r)
    assert (cache.used, list(cache.entries)) == (2 * REUSED, [0, 1])
    assert cache.take(records[0]) == REUSED and list(cache.entries) == [1, 0]
    cache.received(records[2])
    assert list(cache.entries) == [0, 2] and cache.used == 2 * REUSED
    cache.received(records[3])  # 10 tokens: no whole block, never cached
    assert list(cache.entries) == [0, 2]
    cache.received(records[4])  # 48 tokens, the whole prompt: its last block is computed again
    assert cache.peek(records[4]) == 32 and list(cache.entries) == [2, 4]
    assert cache.used == REUSED + 48
    routed = RoutedPrefixes(table, 16)
    assert routed.uncached(records[0]) == PREFIX + SUFFIX
    routed.add(records[0])
    assert routed.uncached(records[0]) == SUFFIX + 8 and routed.blocks(records[0]) == 62
    assert PrefixCache.disabled().peek(records[0]) == 0


def test_one_prefix_id_has_one_length():
    with pytest.raises(ValueError, match="prefix 1 has 900 tokens, but 1000"):
        simulate("colloc", linear_cluster(), LINEAR, [shared(0, 1), shared(1, 1, prefix=900)])


def test_the_prefix_policy_sends_a_prompt_where_its_prefix_went():
    # a long stream holds worker 0; the least loaded worker is then 1, which lacks the prefix
    trace = [shared(0.0, 5, output=1000), shared(5.0, 5)]
    c = {"collocated_workers": 2}
    least = simulate("colloc", linear_cluster(**c), LINEAR, trace).records[1]
    prefix = simulate("colloc", linear_cluster(**c, policy="prefix"), LINEAR, trace).records[1]
    assert least.ttft_s == pytest.approx(PER_TOKEN_S * (PREFIX + SUFFIX))
    # beside the stream: after the step under way, one mixed step of 58 prompt tokens
    assert prefix.ttft_s == pytest.approx(PER_TOKEN_S * (SUFFIX + 8) + DECODE_S, abs=DECODE_S)
    assert linear_cluster(policy="prefix").policy is RoutePolicy.PREFIX
    with pytest.raises(ValueError, match="policy must be one of"):
        linear_cluster(policy="round_robin")


def test_the_prefix_preset():
    spec = make_workload("prefix", 3.0)
    trace = generate_trace(spec, seed=4, num_requests=200)
    assert trace == generate_trace(make_workload("prefix", 3.0), seed=4, num_requests=200)
    assert trace != generate_trace(spec, seed=5, num_requests=200)
    lengths = {r.prefix_id: r.prefix_tokens for r in trace}
    assert set(lengths) == set(range(PREFIX_COUNT))
    assert len(lengths) == len({(r.prefix_id, r.prefix_tokens) for r in trace})
    assert all(PREFIX_TOKENS.low <= n <= PREFIX_TOKENS.high for n in lengths.values())
    assert all(64 <= r.prompt_tokens - r.prefix_tokens <= 512 for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_traces_and_results_carry_prefixes_and_old_ones_still_load(tmp_path):
    rows = [{"arrival_s": 0, "prompt_tokens": 1050, "output_tokens": 3, "prefix_id": 2,
             "prefix_tokens": 1000},
            {"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 3}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)))
    assert read_trace_jsonl(path) == (TraceRequest(0, 1050, 3, 2, 1000), TraceRequest(1, 10, 3))
    new = request(0.0, 1050, 3) | {"prefix_id": 2, "prefix_tokens": 1000}
    result = write_json(tmp_path / "r.json", serve_result([new, request(1.0, 10, 3)]))
    assert read_trace_file(str(result))[0] == (TraceRequest(0.0, 1050, 3, 2, 1000),
                                               TraceRequest(1.0, 10, 3))
    old = write_json(tmp_path / "old.json", serve_result([request(0.0, 1050, 3)]))
    assert load_measured_run(str(old), "--compare-measured").trace == (
        TraceRequest(0.0, 1050, 3, None, 0),)


@pytest.mark.parametrize(("fields", "message"), [
    ({"prefix_tokens": 5}, "prefix_tokens must be 0 without a prefix_id"),
    ({"prefix_id": 1, "prefix_tokens": 0}, "prefix_tokens must be an integer >= 1"),
    ({"prefix_id": -1, "prefix_tokens": 5}, "prefix_id must be an integer >= 0"),
    ({"prefix_id": 1, "prefix_tokens": 11}, r"prefix_tokens \(11\) must be <= prompt_tokens"),
])
def test_bad_prefix_fields_are_refused(tmp_path, fields, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 1}
                               | fields))
    with pytest.raises(ValueError, match=message):
        read_trace_jsonl(path)


def test_simulate_policy_flag_routes_prompts_to_their_prefix(capsys):
    from tests.planner.cli_run import run_pdserve

    mean = {}
    for policy in ("least_loaded", "prefix"):
        rc, out, err = run_pdserve(
            ["simulate", "--model", "smollm2-135m", "--gpu", "cpu", "--workload", "prefix",
             "--rate", "1", "--num-requests", "100", "--layouts", "colloc", "--collocated", "3",
             "--policy", policy, "--json"], capsys)
        assert rc == 0, err
        got = json.loads(out)
        assert got["policy"] == policy
        mean[policy] = got["results"][0]["mean_ttft_ms"]
    # three workers: by prefix, each shared prefix is computed on one of them, not on all three
    assert mean["prefix"] < 0.95 * mean["least_loaded"]
