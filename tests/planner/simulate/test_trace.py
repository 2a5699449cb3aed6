"""Arrival traces: seeded Poisson arrivals, workload presets, JSONL files and bad input."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest

from pdserve.planner.simulate.trace import (
    BURST_PERIOD_S,
    LengthDist,
    TraceRequest,
    generate_trace,
    make_workload,
    read_trace_jsonl,
)


def test_the_same_seed_gives_the_same_trace():
    spec = make_workload("mixed", 5)
    assert generate_trace(spec, seed=7, duration_s=60) == generate_trace(spec, 7, duration_s=60)
    assert generate_trace(spec, seed=7, duration_s=60) != generate_trace(spec, 8, duration_s=60)


def test_poisson_gaps_have_mean_one_over_rate():
    trace = generate_trace(make_workload("chat", 10), seed=0, num_requests=20_000)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.05)  # exponential: sd = mean
    assert all(g >= 0 for g in gaps)


def test_duration_and_count_bound_the_trace():
    spec = make_workload("chat", 4)
    by_time = generate_trace(spec, seed=1, duration_s=30)
    assert all(r.arrival_s < 30 for r in by_time)
    assert 80 < len(by_time) < 160
    assert len(generate_trace(spec, seed=1, num_requests=17)) == 17
    assert generate_trace(spec, seed=1, num_requests=17) == by_time[:17]


@pytest.mark.parametrize(("name", "prompt", "output"), [
    ("chat", (128, 1024), (128, 512)), ("rag", (3600, 4400), (450, 550))])
def test_presets_draw_lengths_from_their_ranges(name, prompt, output):
    trace = generate_trace(make_workload(name, 2), seed=3, num_requests=2000)
    assert all(prompt[0] <= r.prompt_tokens <= prompt[1] for r in trace)
    assert all(output[0] <= r.output_tokens <= output[1] for r in trace)
    assert statistics.fmean(r.prompt_tokens for r in trace) == pytest.approx(sum(prompt) / 2,
                                                                             rel=0.03)


def test_rag_has_the_4000_in_500_out_shape():
    trace = generate_trace(make_workload("rag", 2), seed=0, num_requests=3000)
    assert statistics.fmean(r.prompt_tokens for r in trace) == pytest.approx(4000, rel=0.01)
    assert statistics.fmean(r.output_tokens for r in trace) == pytest.approx(500, rel=0.01)


def test_fixed_preset_uses_exact_lengths():
    trace = generate_trace(make_workload("fixed", 3, 777, 33), seed=0, num_requests=50)
    assert {(r.prompt_tokens, r.output_tokens) for r in trace} == {(777, 33)}


def test_mixed_adds_bursts_of_long_prompts():
    spec = make_workload("mixed", 10)
    assert spec.bursts is not None and spec.bursts.size == 10  # 10% of 10 req/s x 10 s
    assert spec.rate == pytest.approx(10)
    trace = generate_trace(spec, seed=0, duration_s=60)
    long = [r for r in trace if r.prompt_tokens >= 6000]
    assert len(long) == 6 * 10  # bursts at 5, 15, ..., 55 s
    for r in long:
        start = (r.arrival_s // BURST_PERIOD_S + 0.5) * BURST_PERIOD_S
        assert start <= r.arrival_s < start + 1.0
    assert list(trace) == sorted(trace, key=lambda r: r.arrival_s)


def test_jsonl_trace_is_read_and_sorted(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 2.5, "prompt_tokens": 10, "output_tokens": 3},
            {"arrival_s": 0, "prompt_tokens": 4000, "output_tokens": 500, "extra": "ignored"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_trace_jsonl(path) == (TraceRequest(0, 4000, 500), TraceRequest(2.5, 10, 3))


@pytest.mark.parametrize(("text", "message"), [
    ('{"arrival_s": 0, "prompt_tokens": 5}', r"line 1: missing output_tokens"),
    ('\n{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 1}', r"line 2: arrival_s must"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}', r"prompt_tokens must be"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1.5}', r"output_tokens must be"),
    ("[1, 2]", r"line 1: expected a JSON object"),
    ("{oops", r"line 1: not valid JSON"),
    ("\n\n", r"holds no requests"),
])
def test_bad_jsonl_traces_name_the_line(tmp_path, text, message):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_trace_jsonl(path)


def test_missing_trace_file(tmp_path):
    with pytest.raises(ValueError, match=r"trace \(--trace\) .* cannot be read"):
        read_trace_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(("call", "message"), [
    (lambda: make_workload("chat", 0), r"rate \(--rate\) must be a positive"),
    (lambda: make_workload("chat", float("nan")), r"rate \(--rate\)"),
    (lambda: make_workload("poetry", 1), r"workload \(--workload\) must be one of"),
    (lambda: make_workload("fixed", 1, 100), r"needs --prompt-tokens and --output-tokens"),
    (lambda: make_workload("fixed", 1, 0, 5), r"prompt_tokens \(--prompt-tokens\)"),
    (lambda: make_workload("rag", 1, 100, 5), r"go with --workload fixed"),
    (lambda: generate_trace(make_workload("chat", 1), 0), r"exactly one of duration_s"),
    (lambda: generate_trace(make_workload("chat", 1), 0, 5, 5), r"exactly one of duration_s"),
    (lambda: generate_trace(make_workload("chat", 1), -1, 5), r"seed \(--seed\)"),
    (lambda: generate_trace(make_workload("chat", 1), 0, -5), r"duration_s \(--duration-s\)"),
    (lambda: generate_trace(make_workload("chat", 1), 0, None, 0), r"num_requests"),
    (lambda: LengthDist(10, 5), r"high \(5\) must be >= low \(10\)"),
    (lambda: TraceRequest(0.0, 1, 0), r"output_tokens must be"),
])
def test_bad_inputs_raise_naming_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()
