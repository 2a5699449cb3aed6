"""Fitting step costs to worker step traces: exact on a line, robust to slow outliers, mixed steps
left out (or used, less their decode part, when there is no pure prefill step); decode steps with
their contexts (6 fields) fit overhead + per_seq x B + per_context_token x C with every
coefficient >= 0, 5-field traces as before; prefill steps with their attention pairs (7 fields)
fit overhead + per_token x N + per_attention_pair x A."""

from __future__ import annotations

import pytest

from pdserve.planner.simulate import step_fit
from pdserve.planner.simulate.step_fit import Step, fit_step_traces, is_steps_file, parse_steps
from tests.planner.simulate.step_files import (
    BATCHES,
    C1,
    CONTEXTS,
    D0,
    D1,
    P0,
    P1,
    PA,
    attention_prefill_steps,
    context_decode_steps,
    decode_steps,
    disagg_workers,
    prefill_steps,
)


def fit(workers: dict, decode_time: str = "period"):
    parsed = {w: parse_steps(rows, w) for w, rows in workers.items()}
    return fit_step_traces(parsed, decode_time, source="test")


def assert_machine(p, d0=D0, d1=D1, p0=P0, p1=P1):
    assert p.decode_overhead_s == pytest.approx(d0, rel=1e-9)
    assert p.decode_per_seq_s == pytest.approx(d1, rel=1e-9)
    assert p.prefill_overhead_s == pytest.approx(p0, rel=1e-9)
    assert p.prefill_per_token_s == pytest.approx(p1, rel=1e-9)


@pytest.mark.parametrize("decode_time", ["period", "duration"])
def test_steps_on_a_line_are_fitted_exactly(decode_time):
    p = fit(disagg_workers(), decode_time)
    assert_machine(p)
    assert p.decode_per_context_token_s == 0  # steps do not record contexts
    assert p.fit_rows == 5 * len(BATCHES) + 3 * 4
    assert p.max_rel_error == pytest.approx(0, abs=1e-9)


def test_slow_outliers_are_dropped_by_the_group_medians():
    workers = {"prefill-0": prefill_steps(slow=1), "decode-0": decode_steps(slow=2)}
    assert_machine(fit(workers))


def test_period_charges_the_gap_between_steps_duration_does_not():
    workers = disagg_workers(gap=0.001)
    assert_machine(fit(workers, "period"), d0=D0 + 0.001)
    assert_machine(fit(workers, "duration"))


def test_an_idle_period_after_a_step_is_an_outlier():
    decode = decode_steps()
    decode[7:] = [[s + 30.0, e + 30.0, *rest] for s, e, *rest in decode[7:]]  # idle 30 s
    assert_machine(fit({"prefill-0": prefill_steps(), "decode-0": decode}))


def test_workers_are_ordered_by_start_and_kept_apart():
    decode = decode_steps()
    other = decode_steps(t0=1000.005)  # interleaved in time with `decode`, another worker
    workers = {"prefill-0": prefill_steps(), "decode-0": decode[::-1], "decode-1": other}
    assert_machine(fit(workers))


def test_mixed_steps_do_not_move_the_fit():
    workers = disagg_workers()
    workers["collocated-0"] = [[0.0, 9.0, 500, 4, 5], [10.0, 10.5, 30, 60, 61]]
    assert_machine(fit(workers))


def test_without_pure_prefill_steps_mixed_steps_less_their_decode_part_fit_prefill():
    mixed, t = [], 1000.0
    for n, b in [(100, 1), (400, 3), (1600, 2), (6000, 5), (400, 8)]:
        d = max(P0, D0) + P1 * n + D1 * b
        mixed.append([t, t + d, n, b, b + 1])
        t += d
    p = fit({"collocated-0": decode_steps() + mixed})
    assert_machine(p, p0=max(P0, D0))


def test_zero_length_and_empty_steps_are_skipped():
    workers = disagg_workers()
    workers["decode-0"] += [[5000.0, 5000.0, 0, 3, 3], [6000.0, 6001.0, 0, 0, 0]]
    assert_machine(fit(workers, "duration"))


@pytest.mark.parametrize("workers, message", [
    ({"prefill-0": prefill_steps()}, "no decode-only step"),
    ({"decode-0": decode_steps()}, "no prefill step"),
    ({"decode-0": decode_steps(), "prefill-0": [[0, 0.5, 100, 0, 1], [1, 1.1, 6000, 0, 1]]},
     "do not grow with their tokens"),
])
def test_what_cannot_be_fitted_is_named(workers, message):
    with pytest.raises(ValueError, match=message):
        fit(workers)


def test_unknown_decode_time_is_refused():
    with pytest.raises(ValueError, match="--step-time"):
        fit(disagg_workers(), "wall")


@pytest.mark.parametrize("row, message", [
    ([1.0, 2.0, 0, 3], r"expected \[start_s, end_s"),
    ("1,2,0,3,3", r"expected \[start_s, end_s"),
    ([1.0, "2", 0, 3, 3], "end_s must be a finite number"),
    ([1.0, float("nan"), 0, 3, 3], "end_s must be a finite number"),
    ([1.0, 2.0, -1, 3, 3], "prefill_tokens must be an integer >= 0"),
    ([1.0, 2.0, 0, 2.5, 3], "decode_tokens must be an integer >= 0"),
    ([1.0, 2.0, 0, 3, True], "num_requests must be an integer >= 0"),
    ([2.0, 1.0, 0, 3, 3], "end_s 1.0 is before start_s 2.0"),
])
def test_bad_step_rows_name_the_worker_and_the_step(row, message):
    with pytest.raises(ValueError, match=f"decode-0 step 2: {message}"):
        parse_steps([[0.0, 0.5, 0, 1, 1], row], "decode-0")


def test_parsed_steps_keep_their_fields():
    assert parse_steps([[1, 2.5, 7, 3, 4]], "w") == [Step(1, 2.5, 7, 3, 4)]
    assert parse_steps([[1, 2.5, 7, 3, 4, 900]], "w") == [Step(1, 2.5, 7, 3, 4, 900)]


def test_old_five_field_steps_have_no_context():
    assert parse_steps([[1, 2.5, 0, 3, 3]], "w")[0].decode_context is None


@pytest.mark.parametrize("data, expected", [
    ({"decode-0": [], "prefill-0": [[0, 1, 5, 0, 1]]}, True),
    ({"disagg": {"decode-0": []}, "collocated": {"collocated-0": []}}, True),
    ({}, False),
    ({"schema": "pdserve.calibration-profile/1", "decode": {}}, False),
    ({"phase": "decode", "batch": 1}, False),
    ({"disagg": {"median_ttft_ms": 1.0, "requests": []}}, False),
    ([[0, 1, 5, 0, 1]], False),
])
def test_steps_files_are_told_by_shape(data, expected):
    assert is_steps_file(data) is expected


def test_a_stray_pure_prefill_step_does_not_price_every_prompt_token():
    """A busy collocated worker's only pure prefill step was a 1-token prompt tail of 60 ms
    (measured); with more mixed steps than pure ones, the mixed steps join the fit."""
    mixed, t = [], 1000.0
    for n, b in [(100, 1), (400, 3), (1600, 2), (6000, 5), (400, 8)]:
        d = max(P0, D0) + P1 * n + D1 * b
        mixed.append([t, t + d, n, b, b + 1])
        t += d
    stray = [[t + 1, t + 1 + max(P0, D0) + P1, 1, 0, 1]]
    p = fit({"collocated-0": decode_steps() + mixed + stray})
    assert_machine(p, p0=max(P0, D0))


# ---- decode steps with their contexts (6 fields) ------------------------------------------------


def assert_decode(p, d0=D0, d1=D1, c1=C1):
    assert p.decode_overhead_s == pytest.approx(d0, rel=1e-9, abs=1e-12)
    assert p.decode_per_seq_s == pytest.approx(d1, rel=1e-9, abs=1e-12)
    assert p.decode_per_context_token_s == pytest.approx(c1, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("decode_time", ["period", "duration"])
@pytest.mark.parametrize("spread", [0, 1])
def test_known_decode_costs_with_context_are_recovered_exactly(decode_time, spread):
    """Contexts varying within a group (spread 1) stay exact: median t = model(median C)."""
    p = fit({"prefill-0": prefill_steps(), "decode-0": context_decode_steps(spread=spread)},
            decode_time)
    assert_decode(p)
    assert p.prefill_overhead_s == pytest.approx(P0) and p.prefill_per_token_s == pytest.approx(P1)
    assert p.fit_rows == 5 * len(BATCHES) * len(CONTEXTS) + 3 * 4
    assert p.max_rel_error == pytest.approx(0, abs=1e-9)


def test_a_few_slow_decode_steps_do_not_move_the_context_fit():
    decode = context_decode_steps()
    for i in (3, 20, 41, 62):  # four descheduled steps in four groups of five
        start, end, *rest = decode[i]
        decode[i] = [start, start + 20 * (end - start), *rest]
    assert_decode(fit({"prefill-0": prefill_steps(), "decode-0": decode}, "duration"))


def test_an_idle_period_after_a_context_step_is_an_outlier():
    decode = context_decode_steps()
    decode[40:] = [[s + 30.0, e + 30.0, *rest] for s, e, *rest in decode[40:]]  # idle 30 s
    assert_decode(fit({"prefill-0": prefill_steps(), "decode-0": decode}))


def test_contexts_that_do_not_vary_apart_from_b_give_the_two_parameter_fit():
    """One context per sequence: C = 500 B, so per_context_token cannot be told from per_seq;
    per_seq takes it (c = 0), as with 5-field steps."""
    decode = context_decode_steps(contexts=(500,))
    assert_decode(fit({"prefill-0": prefill_steps(), "decode-0": decode}),
                  d1=D1 + C1 * 500, c1=0.0)


def test_a_negative_context_term_is_not_kept():
    decode = context_decode_steps(c1=-0.000001)  # longer contexts a little faster: noise
    p = fit({"prefill-0": prefill_steps(), "decode-0": decode})
    assert p.decode_per_context_token_s == 0
    assert p.decode_overhead_s > 0 and p.decode_per_seq_s > 0


def test_a_single_batch_size_takes_the_rest_as_overhead():
    decode = [row for row in context_decode_steps() if row[3] == 3]  # gaps: time steps alone
    assert_decode(fit({"prefill-0": prefill_steps(), "decode-0": decode}, "duration"),
                  d0=D0 + 3 * D1, d1=0.0)


def _held(decode: list, per_context_s: float):
    parsed = {w: parse_steps(rows, w) for w, rows in
              {"prefill-0": prefill_steps(), "decode-0": decode}.items()}
    return fit_step_traces(parsed, source="test", context_token_s=per_context_s)


def test_a_held_context_cost_fits_the_rest_and_recovers_the_machine_when_right():
    assert_decode(_held(context_decode_steps(), C1))


def test_a_held_context_cost_is_what_tells_it_from_the_stream_cost():
    """One context per sequence (C = 500 B): alone the fit gives per_seq all of it; held at
    the machine's C1, per_seq is the machine's again."""
    decode = context_decode_steps(contexts=(500,))
    assert_decode(_held(decode, C1))
    held_half = _held(decode, C1 / 2)  # the other half of the context cost goes to per_seq
    assert held_half.decode_per_context_token_s == C1 / 2
    assert held_half.decode_per_seq_s == pytest.approx(D1 + 500 * C1 / 2)
    assert held_half.decode_overhead_s == pytest.approx(D0)


def test_steps_on_a_line_keep_the_line():
    p = _held(context_decode_steps(), C1)
    assert (p.decode_knee_batch, p.decode_per_seq_past_knee_s) == (0, 0.0)


@pytest.mark.parametrize("knee", [2, 3])
def test_a_knee_in_the_steps_is_found_and_priced_exactly(knee):
    """Each stream past the knee costs DK more: the held fit finds the knee among the measured
    batch sizes with two on either side, and prices every step exactly."""
    dk = 3 * D1
    p = _held(context_decode_steps(knee=knee, dk=dk), C1)
    assert_decode(p)
    assert p.decode_knee_batch == knee
    assert p.decode_per_seq_past_knee_s == pytest.approx(dk, rel=1e-9)
    assert p.max_rel_error == pytest.approx(0, abs=1e-9)
    assert p.step_seconds([], 8, 800) == pytest.approx(D0 + 8 * D1 + (8 - knee) * dk + 800 * C1)


def test_a_knee_needs_two_measured_batch_sizes_above_it():
    """Steps bend past B = 5 but only B = 8 is above it, too little to place a knee on: the
    fit bends at 3, the last batch size with two above it, and prices B = 8 within 10%."""
    steps = context_decode_steps(knee=5, dk=3 * D1)
    p = _held(steps, C1)
    line = _held(context_decode_steps(), C1)  # the same batches on a line: its shape
    assert p.decode_knee_batch == 3 and line.decode_knee_batch == 0
    truth = D0 + 8 * D1 + 3 * 3 * D1 + 800 * C1
    assert abs(p.step_seconds([], 8, 800) - truth) < 0.1 * truth


def test_streams_cheaper_past_a_batch_keep_the_line():
    """Only a convex bend is a knee (its extra cost is >= 0): steps whose streams get cheaper
    past a batch keep the line, as steps on a line do."""
    batches = (1, 2, 3, 4, 6, 8, 12, 16)
    straight = _held(context_decode_steps(batches=batches), C1)
    concave = _held(context_decode_steps(knee=4, dk=-D1 / 2, batches=batches), C1)
    assert straight.decode_knee_batch == concave.decode_knee_batch == 0


def test_one_slow_batch_size_is_not_a_knee(monkeypatch):
    """Steps on a line but for B = 2, 5% slow: some knee cuts the line's error a little, less
    than KNEE_MIN_GAIN, so the line stays (without the bound, a knee at 8 would be kept)."""
    rows, t = [], 1000.0
    for start, end, *rest in context_decode_steps(batches=(1, 2, 3, 4, 6, 8, 12, 16)):
        d = (end - start) * (1.05 if rest[1] == 2 else 1.0)
        rows.append([t, t + d, *rest])
        t += d
    assert _held(rows, C1).decode_knee_batch == 0
    monkeypatch.setattr(step_fit, "KNEE_MIN_GAIN", 0.0)
    assert _held(rows, C1).decode_knee_batch == 8


def test_mixed_steps_less_their_decode_part_past_the_knee_fit_prefill():
    """A collocated worker without pure prefill steps: the mixed ones, less the streams' cost
    with its knee, price the prompt tokens exactly."""
    knee, dk = 3, 3 * D1
    mixed, t = [], 1000.0
    for n, b, c in [(100, 1, 300), (400, 8, 2000), (1600, 2, 700), (6000, 5, 9000)] * 3:
        d = P0 + P1 * n + D1 * b + dk * max(0, b - knee) + C1 * c
        mixed.append([t, t + d, n, b, b + 1, c])
        t += d + 1.0
    decode = context_decode_steps(knee=knee, dk=dk, t0=t + 10)
    parsed = {"w": parse_steps(mixed + decode, "w")}
    p = fit_step_traces(parsed, source="test", context_token_s=C1)
    assert p.decode_knee_batch == knee
    assert (p.prefill_overhead_s, p.prefill_per_token_s) == (pytest.approx(P0),
                                                             pytest.approx(P1))


def test_a_held_context_cost_above_the_steps_is_refused():
    with pytest.raises(ValueError, match=r"test: a decode context cost of 100 us per token "
                                         r"prices steps of 1 streams over 400 context tokens"):
        _held(context_decode_steps(), 100e-6)


def test_a_held_context_cost_needs_steps_that_record_contexts():
    with pytest.raises(ValueError, match="needs steps that record their decode context"):
        _held(decode_steps(), C1)

def test_a_worker_with_five_field_steps_makes_the_contexts_unknown():
    """Old and new traces pooled: the context is not known for every step, so none is used."""
    workers = {"prefill-0": prefill_steps(), "decode-0": decode_steps(),
               "decode-1": context_decode_steps(c1=0.0)}
    p = fit(workers)
    assert_machine(p)
    assert p.decode_per_context_token_s == 0


def test_mixed_steps_less_their_decode_part_with_context_fit_prefill():
    mixed, t = [], 1000.0
    for n, b, c in [(100, 1, 300), (400, 3, 2000), (1600, 2, 700), (6000, 5, 9000),
                    (400, 8, 1200)]:
        d = max(P0, D0) + P1 * n + D1 * b + C1 * c
        mixed.append([t, t + d, n, b, b + 1, c])
        t += d
    p = fit({"collocated-0": context_decode_steps() + mixed})
    assert_decode(p)
    assert p.prefill_overhead_s == pytest.approx(max(P0, D0))
    assert p.prefill_per_token_s == pytest.approx(P1)


@pytest.mark.parametrize("row, message", [
    ([1.0, 2.0, 0, 3, 3, 2.5], "decode_context must be an integer >= 0"),
    ([1.0, 2.0, 0, 3, 3, -4], "decode_context must be an integer >= 0"),
    ([1.0, 2.0, 0, 3, 3, False], "decode_context must be an integer >= 0"),
    ([1.0, 2.0, 0, 3, 3, "900"], "decode_context must be an integer >= 0"),
    ([1.0, 2.0, 0, 3, 3, None], "decode_context must be an integer >= 0"),
    ([1.0, 2.0, 0, 3, 3, 2], "decode_context 2 is below decode_tokens 3"),
    ([1.0, 2.0, 50, 0, 1, 7], "decode_context must be 0 in a step without decode tokens"),
    ([1.0, 2.0, 0, 3, 3, 900, 0, 1], r"expected \[start_s, end_s"),
    ([1.0, 2.0, 0, 3, 3, 900, 1], "prefill_attention 1 must be 0 without prompt tokens"),
    ([1.0, 2.0, 50, 0, 1, 0, 49], "prefill_attention 49 must be 0 without prompt tokens and "
                                  "at least prefill_tokens 50"),
    ([1.0, 2.0, 50, 0, 1, 0, -1], "prefill_attention must be an integer >= 0"),
])
def test_a_bad_context_names_the_worker_and_the_step(row, message):
    with pytest.raises(ValueError, match=f"decode-0 step 2: {message}"):
        parse_steps([[0.0, 0.5, 0, 1, 1, 1], row], "decode-0")


def test_prefill_steps_with_their_attention_fit_the_pairs_exactly():
    steps = {"prefill-0": attention_prefill_steps(), "decode-0": context_decode_steps()}
    p = fit(steps)
    assert_decode(p)
    assert p.prefill_overhead_s == pytest.approx(P0, rel=1e-9)
    assert p.prefill_per_token_s == pytest.approx(P1, rel=1e-9)
    assert p.prefill_per_attention_pair_s == pytest.approx(PA, rel=1e-9)
    assert p.max_rel_error == pytest.approx(0, abs=1e-9)


def test_a_long_prompt_costs_more_per_token_than_a_short_one_once_fitted():
    from pdserve.planner.simulate.calibration import Chunk
    p = fit({"prefill-0": attention_prefill_steps(), "decode-0": context_decode_steps()})
    short = p.step_seconds([Chunk(0, 1000, True)], 0, 0) / 1000
    long = p.step_seconds([Chunk(0, 4000, True)], 0, 0) / 4000
    late = p.step_seconds([Chunk(3800, 200, True)], 0, 0) / 200  # the same 200 after 3,800
    assert long > short and late > long
    assert late == pytest.approx((P0 + P1 * 200 + PA * (200 * 3800 + 200 * 201 // 2)) / 200)


def test_mixed_steps_with_attention_fit_once_the_decode_costs_are_known():
    mixed, t = [], 1000.0
    for n, start, b, c in [(100, 0, 1, 300), (400, 0, 3, 2000), (400, 1200, 2, 700),
                           (1600, 0, 5, 9000), (1600, 3000, 8, 1200), (200, 6000, 2, 500)]:
        a = n * start + n * (n + 1) // 2
        d = max(P0, D0) + P1 * n + PA * a + D1 * b + C1 * c
        mixed.append([t, t + d, n, b, b + 1, c, a])
        t += d
    p = fit({"collocated-0": context_decode_steps() + mixed})
    assert_decode(p)
    assert p.prefill_overhead_s == pytest.approx(max(P0, D0))
    assert p.prefill_per_token_s == pytest.approx(P1)
    assert p.prefill_per_attention_pair_s == pytest.approx(PA)


def test_traces_without_attention_fit_no_attention_cost():
    p = fit(disagg_workers())
    assert p.prefill_per_attention_pair_s == 0
