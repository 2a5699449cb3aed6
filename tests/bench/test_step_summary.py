"""What each worker's engine did during a measured run (`bench compare`'s lines under the
table): decode-only steps and their cost per stream, prompt steps, time busy."""

from __future__ import annotations

import pytest

from pdserve.bench.compare import format_table
from pdserve.bench.step_summary import format_summary, summarize

# [start, end, prefill_tokens, decode_tokens, num_requests]: two decode-only steps of 8 and 6
# streams (30 and 40 ms), one prompt step of 200 tokens beside 8 streams (150 ms), one before
# the run and one after it
ROWS = [[99.0, 99.5, 500, 0, 1], [100.0, 100.03, 0, 8, 8], [100.1, 100.14, 0, 6, 6],
        [100.2, 100.35, 200, 8, 9], [111.0, 111.1, 0, 8, 8]]


def test_a_workers_steps_within_the_run_are_summed_by_kind():
    s = summarize(ROWS, 100.0, 110.0)
    assert s["decode_steps"] == 2 and s["decode_batch"] == pytest.approx(7.0)
    assert s["decode_step_ms"] == pytest.approx(35.0)  # median of 30 and 40
    assert s["stream_ms"] == pytest.approx(5.0)
    assert (s["prompt_steps"], s["prompt_tokens"]) == (1, 200)
    assert s["prompt_s"] == pytest.approx(0.15) and s["busy_s"] == pytest.approx(0.22)
    assert (s["paced_steps"], s["paced_ms"]) == (1, pytest.approx(150.0))
    assert format_summary(s, 10.0) == ("busy 0.2 of 10.0 s; 2 decode-only steps (batch 7.0, "
                                       "median 35.0 ms, 5.00 ms a stream); 1 prompt step "
                                       "(200 tokens, 0.1 s, 1 beside streams (median 150 ms, "
                                       "P99 150 ms))")


def test_a_worker_that_only_prefilled_has_no_decode_figures():
    s = summarize(ROWS[:1], 0.0, 200.0)
    assert (s["decode_steps"], s["decode_batch"], s["stream_ms"]) == (0, 0.0, 0.0)
    assert (s["paced_steps"], s["paced_p99_ms"]) == (0, 0.0)
    assert format_summary(s, 200.0).endswith("no decode-only step; 1 prompt step (500 tokens, "
                                             "0.5 s)")


def test_the_paced_steps_median_and_p99_are_those_beside_streams():
    """100 chunk steps beside streams of 80..179 ms and one whole prompt alone (2 s): the
    whole prompt is no paced step; P99 is the 99th of the 100 by nearest rank."""
    rows = [[float(i), i + (80 + i) / 1e3, 96, 3, 4] for i in range(100)]
    rows.append([200.0, 202.0, 1500, 0, 1])
    s = summarize(rows, 0.0, 300.0)
    assert s["paced_steps"] == 100 and s["prompt_steps"] == 101
    assert s["paced_ms"] == pytest.approx(129.5) and s["paced_p99_ms"] == pytest.approx(178.0)


def test_the_table_has_a_line_per_worker_of_each_pdserve_configuration():
    workers = {"prefill-0": {"flips": 0, "steps": summarize(ROWS[:1], 0.0, 200.0)},
               "decode-0": {"flips": 0, "steps": summarize(ROWS, 100.0, 110.0)}}
    results = {"disagg": {"run_window": [100.0, 110.0], "workers": workers}, "vllm": {}}
    lines = format_table(results, repeats=2).splitlines()
    at = lines.index("engine steps of each worker during the last run:")
    assert lines[at + 1].startswith("  disagg prefill-0: busy 0.5 of 10.0 s; no decode-only")
    assert lines[at + 2].startswith("  disagg decode-0: busy 0.2 of 10.0 s; 2 decode-only")
    assert "engine steps" not in format_table({"vllm": {}})
