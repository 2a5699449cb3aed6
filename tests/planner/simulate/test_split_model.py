"""A split layout's routing in the simulator: the router's measured-cost choice between a
remote and a local prefill, and a decode worker's paced local prefills beside its streams."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from pdserve.planner.simulate.calibration import Chunk
from pdserve.planner.simulate.cluster import Cluster
from pdserve.planner.simulate.events import SimResult, simulate
from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.split_model import (
    DEFAULT_TPOT_TARGET_S,
    Route,
    Seen,
    SplitRule,
    local_rate,
    route,
)
from pdserve.planner.simulate.step_window import WINDOW, Rates, StepWindow
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.simulate.test_events import COSTS, HOL_TRACE

DECODE_S = 2**-6  # a step that decodes: 15.625 ms whatever the batch
TOKEN_S = 2**-13  # a prompt token: 8192 tokens/s
TPOT = 2**-4  # 62.5 ms: beside streams, C = (TPOT - DECODE_S) / TOKEN_S = 384 tokens a step
KV_BYTES = 2**10  # per token: 8192 tokens take 0.67 ms on 100 Gb/s


@dataclass(frozen=True)
class Linear:
    """Step costs in powers of two, so the expected times below are exact."""

    context_s: float = 0.0  # per context token of the decodes

    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        return ((DECODE_S if decodes else 0.0) + self.context_s * context_sum
                + TOKEN_S * sum(c.tokens for c in chunks))


def cluster(split: str, **kw: object) -> Cluster:
    base = {"kv_capacity_tokens": 1_000_000, "kv_bytes_per_token_rank": KV_BYTES,
            "link_gbps": 100.0, "split": split, "tpot_target_s": TPOT}
    return Cluster(**(base | kw))  # type: ignore[arg-type]


def run(split: str, trace: list[TraceRequest], **kw: object) -> SimResult:
    return simulate("disagg", cluster(split, **kw), Linear(), trace, trace_tokens=True)


def gaps(record: RequestRecord) -> list[float]:
    return [b - a for a, b in itertools.pairwise(record.token_times or [])]


def step_end_after(first_token_s: float, t: float) -> float:
    """The end of the decode step in progress at `t` of a lone stream whose token 0 came at
    `first_token_s` (steps of DECODE_S back to back)."""
    k = -((first_token_s - t) // DECODE_S)
    return first_token_s + k * DECODE_S


# ---- the rule ------------------------------------------------------------------------------------


def seen(rate: float | None = None, backlog: int = 0, legs: int = 0, chunk: int | None = None,
         step_s: float | None = None, marginal: float | None = None) -> Seen:
    """A worker reporting `rate` (and R_m = `marginal`, else `rate`)."""
    return Seen(Rates(rate, step_s, marginal or rate), backlog, legs, chunk)


def test_before_any_rate_short_prompts_run_locally_while_nothing_longer_is_queued():
    idle = [seen(), seen(backlog=300)]
    assert route(256, seen(), [256, 256], idle, 0.0) == Route(True, None, None, None)
    assert route(257, seen(), [257, 257], idle, 0.0).local is False  # over the threshold
    assert route(200, seen(backlog=100), [200, 200], idle, 0.0).local is False  # 300 > 256
    # queued here 300 + 200, on the least loaded prefill worker 0 + 600 (it lacks more)
    assert route(200, seen(backlog=300), [600, 900], idle, 0.0).local is True


def test_route_compares_queue_plus_service_times_and_picks_the_soonest_prefill_worker():
    prefill = [seen(2000.0, 3000), seen(2000.0, 500), seen(2000.0, 500)]
    r = route(1000, seen(1000.0), [1000] * 3, prefill, 0.25)
    assert (r.t_remote_s, r.prefill_index, r.t_local_s, r.local) == (1.0, 1, 1.0, True)
    r = route(1000, seen(1000.0, backlog=1), [1000] * 3, prefill, 0.25)
    assert r.local is False and r.t_local_s == 1.001


def test_route_counts_each_prefill_worker_with_the_tokens_it_lacks():
    # worker 1 holds the prompt's prefix: 100 tokens there against 1,000 at worker 0
    r = route(1000, seen(1000.0), [1000, 100], [seen(1000.0), seen(1000.0, 500)], 0.0)
    assert (r.prefill_index, r.t_remote_s) == (1, 0.6)
    r = route(100, seen(1000.0), [1000], [seen(1000.0)], 0.0)  # only d holds it: local
    assert r.local and (r.t_local_s, r.t_remote_s) == (0.1, 1.0)


def test_a_worker_that_reports_no_rate_counts_at_the_mean_of_those_reported():
    # d reports 1,000/s, prefill worker 1 3,000/s, worker 0 nothing: 2,000/s for it
    r = route(1000, seen(1000.0), [1000, 1000], [seen(), seen(3000.0, 5000)], 0.0)
    assert (r.prefill_index, r.t_remote_s, r.local) == (0, 0.5, False)


def test_beside_open_legs_a_prompt_progresses_a_chunk_per_decode_step_plus_its_own_part():
    # R_m 1,000/s, decode step 50 ms, chunk 100: 100 / (0.05 + 0.1) = 666.7 tokens/s
    d = seen(800.0, legs=2, chunk=100, step_s=0.05, marginal=1000.0)
    assert local_rate(d, 5000, 0.0) == pytest.approx(100 / 0.15)
    assert local_rate(d, 50, 0.0) == pytest.approx(50 / 0.1)  # the prompt is under a chunk
    assert local_rate(seen(800.0, legs=2, step_s=0.05, marginal=1000.0), 500, 0.0) == \
        pytest.approx(500 / 0.55)  # no chunk timed yet: the whole prompt in one step
    assert local_rate(seen(800.0, step_s=0.05, marginal=1000.0), 500, 0.0) == 1000.0  # alone
    no_marginal = Seen(Rates(800.0, 0.05, None), 0, 2, 100)
    assert local_rate(no_marginal, 500, 0.0) == 800.0  # its whole-step average
    assert local_rate(seen(legs=2), 500, 1234.0) == 1234.0  # nothing: the pool's mean


def test_a_workers_window_reports_its_newest_steps_of_each_kind():
    w = StepWindow()
    assert w.rates() == Rates()
    w.record(1000, 0, 0.5)  # a prompt alone
    w.record(100, 4, 0.07)  # a prompt beside 4 streams
    for _ in range(WINDOW + 1):
        w.record(0, 4, 0.02)
    w.record(0, 0, 1.0)  # no work: not timed
    w.record(50, 0, 0.0)  # no time: not timed
    rates = w.rates()
    assert rates.prefill_tokens_per_s == pytest.approx(1100 / 0.57)
    assert rates.decode_step_s == 0.02 and len(w.decode) == WINDOW
    assert rates.marginal_tokens_per_s == pytest.approx(1100 / 0.55)  # 50 ms of 70 the prompt's


def test_the_defaults_are_the_original_model_and_pdserve_ups_target():
    c = Cluster(kv_capacity_tokens=10, kv_bytes_per_token_rank=1, link_gbps=1.0)
    assert c.split is SplitRule.REMOTE and c.tpot_target_s == DEFAULT_TPOT_TARGET_S == 0.1
    assert cluster("measured").split is SplitRule.MEASURED


# ---- local and remote prefills -------------------------------------------------------------------


def test_an_idle_cluster_keeps_a_prompt_local_and_saves_the_transfer():
    # W (100 tokens, before any rate: under the threshold) runs locally, and the decode worker
    # reports its rate; then the idle cluster keeps a 1,000-token prompt local too
    trace = [TraceRequest(0.0, 100, 2), TraceRequest(1.0, 1000, 4)]
    local = run("measured", trace)
    r = local.records[1]
    assert local.local_prefills == 2 and local.busy["prefill"] == 0.0
    assert r.ttft_s == 1000 * TOKEN_S and gaps(r) == [DECODE_S] * 3
    assert run("measured", trace[1:]).local_prefills == 0  # no rate yet: over the threshold
    remote = run("remote", trace)
    transfer = cluster("remote").transfer_seconds(1000)
    assert remote.local_prefills == 0 and remote.records[1].ttft_s == 1000 * TOKEN_S
    assert gaps(remote.records[1]) == pytest.approx([transfer + DECODE_S] + [DECODE_S] * 2,
                                                    rel=1e-12)


def test_a_stream_sends_a_long_prompt_remote_and_a_loaded_prefill_worker_the_next_local():
    # A streams on the decode worker; at 1.5 s, after the router's health check at 1 s read
    # A's steps, B and C (8192 tokens each) arrive together.
    # B: locally 8192 / 6144 tok/s (paced) = 1.33 s, remotely 1 s + 0.67 ms: remote.
    # C: behind B remotely 2 s + 0.67 ms, locally 1.33 s: local, 384 tokens a step beside A.
    trace = [TraceRequest(0.0, 100, 400), TraceRequest(1.5, 8192, 2),
             TraceRequest(1.5, 8192, 2)]
    result = run("measured", trace)
    a, b, c = result.records
    assert result.local_prefills == 2  # A (idle cluster) and C
    assert a.ttft_s == 100 * TOKEN_S and b.ttft_s == 1.0
    start = step_end_after(a.first_token_s, 1.5)  # C's first chunk starts there
    assert c.first_token_s == start + 21 * TPOT + (DECODE_S + 128 * TOKEN_S)  # 21 x 384 + 128
    chunked = [g for g in gaps(a) if g > DECODE_S]
    assert chunked == [TPOT] * 21 + [DECODE_S + 128 * TOKEN_S]  # every step within the target
    assert all(r.finish_s is not None for r in result.records)


def test_a_fixed_hand_over_cost_keeps_a_prompt_local_that_the_wire_alone_would_split():
    """The trace above: B remotely 1 s + 0.67 ms against 1.33 s locally went remote; with
    every hand-over costing 0.5 s before the wire (--link-fixed-ms 500), remote is 1.5 s and
    B stays local; C, behind B locally (2.67 s), goes to the idle prefill worker (1.5 s)."""
    trace = [TraceRequest(0.0, 100, 400), TraceRequest(1.5, 8192, 2),
             TraceRequest(1.5, 8192, 2)]
    assert [r.local for r in run("measured", trace).records] == [True, False, True]
    slow = run("measured", trace, link_fixed_s=0.5)
    assert [r.local for r in slow.records] == [True, True, False]
    c = slow.records[2]
    assert c.ttft_s == pytest.approx(8192 * TOKEN_S)  # token 0 at its prefill's end
    assert gaps(c)[0] > 0.5  # its KV waits out the fixed cost before its first decode


def test_the_router_reads_the_rates_at_its_health_checks_only():
    """At 0.5 s A's steps have run, but the router's last health check (at 0 s) read nothing
    yet: B and C go by the rule for unmeasured workers, both split (over 256 tokens)."""
    trace = [TraceRequest(0.0, 100, 400), TraceRequest(0.5, 8192, 2),
             TraceRequest(0.5, 8192, 2)]
    result = run("measured", trace)
    assert [r.local for r in result.records] == [True, False, False]
    assert result.local_prefills == 1


def test_the_local_rule_paces_a_long_prompt_to_the_target_beside_a_stream():
    a_remote, b_remote = simulate("disagg", Cluster(**_roofline("remote")), COSTS, HOL_TRACE,
                                  trace_tokens=True).records
    a_local, b_local = simulate("disagg", Cluster(**_roofline("local")), COSTS, HOL_TRACE,
                                trace_tokens=True).records
    steady = gaps(a_local)[1:]
    decode_only = min(steady)
    assert max(steady) <= 0.05 * (1 + 1e-9)  # A's steps while B prefills: within the target
    assert sum(g > 2 * decode_only for g in steady) >= 3  # B went in chunks beside A
    assert b_local.ttft_s > b_remote.ttft_s  # B progresses slower, paced
    assert max(gaps(a_remote)[1:]) < 2 * decode_only  # remote: A never waits for B


def _roofline(split: str) -> dict[str, object]:
    return {"kv_capacity_tokens": 1_000_000, "link_gbps": 100.0, "split": split,
            "kv_bytes_per_token_rank": COSTS.kv_bytes_per_token_rank, "tpot_target_s": 0.05}


def test_a_target_below_one_decode_step_still_computes_a_block_a_step():
    trace = [TraceRequest(0.0, 100, 100), TraceRequest(0.1, 160, 2)]
    a, b = run("local", trace, tpot_target_s=DECODE_S / 2).records
    start = step_end_after(a.first_token_s, 0.1)
    assert b.first_token_s == start + 10 * (DECODE_S + 16 * TOKEN_S)


def test_with_no_stream_local_prompts_run_whole_and_unpaced_before_a_decode_step_was_timed():
    # P1 and P2 do not fit the 4000-token budget together: P1 runs whole, alone; then P1
    # decodes, and the worker has timed no decode-only step yet (no chunk: nothing measured
    # to protect), so P2 goes whole beside it, as the worker's first mixed step does.
    trace = [TraceRequest(0.0, 4000, 50), TraceRequest(0.0, 4000, 3)]
    p1, p2 = run("local", trace, prefill_budget_tokens=4000).records
    assert p1.ttft_s == 4000 * TOKEN_S
    assert p2.ttft_s == 4000 * TOKEN_S + DECODE_S + 4000 * TOKEN_S
    together = run("local", trace, prefill_budget_tokens=8192).records  # one step for both
    assert [r.ttft_s for r in together] == [8000 * TOKEN_S] * 2


def test_prompts_go_to_the_least_loaded_decode_worker_then_to_an_idle_prefill_worker():
    # W0 and W1 (100 tokens each) run on the two idle decode workers, which report their
    # rates. At 1 s the first two 4,000-token prompts prefill whole on them; the third, behind
    # the first on decode worker 0 and beside its leg (chunks of 384 tokens a 62.5 ms step:
    # 1.3 s), goes to the idle prefill worker (0.49 s + the transfer)
    trace = [TraceRequest(0.0, 100, 2)] * 2 + [TraceRequest(1.0, 4000, 3)] * 3
    result = run("measured", trace, decode_workers=2)
    assert result.local_prefills == 4 and result.busy["prefill"] > 0
    assert [r.ttft_s for r in result.records[2:]] == [4000 * TOKEN_S] * 3


# ---- the original model, and every request completing ------------------------------------------

TRACE = [TraceRequest(i * 0.125, (i * 977) % 6000 + 50, (i * 37) % 60 + 1) for i in range(80)]


def mixed(split: str, **kw: object) -> SimResult:
    c = Cluster(kv_capacity_tokens=20_000, kv_bytes_per_token_rank=2**17, link_gbps=10.0,
                prefill_workers=2, decode_workers=2, split=split, **kw)  # type: ignore[arg-type]
    return simulate("disagg", c, Linear(context_s=2**-20), TRACE)


def test_the_remote_rule_reproduces_the_original_model_exactly():
    # these sums are what the model gave before the split rules (with its 8,192-token budget)
    result = mixed("remote", prefill_budget_tokens=8192)
    assert sum(r.first_token_s for r in result.records) == 625.9857177734375
    assert sum(r.finish_s for r in result.records) == 701.7233098988354
    assert sum(v * n for v, n in zip(result.itl.values, result.itl.counts,
                                     strict=True)) == 75.73759212539781
    assert result.local_prefills == 0


@pytest.mark.parametrize("split", ["local", "measured"])
def test_every_request_completes_under_a_full_kv_and_both_paths(split):
    result = mixed(split, tpot_target_s=0.05)  # simulate raises if KV or a load is left over
    assert all(r.finish_s is not None and r.finish_s >= r.first_token_s for r in result.records)
    assert result.itl.total == sum(r.output_tokens - 1 for r in result.records)
    if split == "measured":
        assert 0 < result.local_prefills < len(TRACE) and result.busy["prefill"] > 0
    else:
        assert result.local_prefills == len(TRACE) and result.busy["prefill"] == 0.0


@dataclass(frozen=True)
class Attending(Linear):
    """Linear, plus PAIR_S per (query, key) pair of the prompt tokens: late chunks cost more."""

    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        pairs = sum(c.tokens * c.start + c.tokens * (c.tokens + 1) // 2 for c in chunks)
        return super().step_seconds(chunks, decodes, context_sum) + PAIR_S * pairs


PAIR_S = 2**-26  # 8192 tokens after 8192 cached: +1 s


def test_paced_steps_overshoot_less_as_the_worker_fits_the_prompts_attention():
    """A's stream, then B (8192 tokens) kept local at 1 s: the worker's first chunks of B come
    from the flat rate A's one short prompt measured, so they pass the target more as they
    attend to more of B; at each refresh (a run of rising gaps ends) its fit has seen B's
    chunks that far in and prices the next ones by their context up to there (never beyond:
    `common/step_cost.py`), so each run overshoots less than the one before."""
    trace = [TraceRequest(0.0, 100, 800), TraceRequest(1.0, 8192, 2)]
    a, b = simulate("disagg", cluster("local"), Attending(), trace, trace_tokens=True).records
    paced = [g for g in gaps(a) if g > DECODE_S * 1.01][:-1]  # less B's short last chunk
    assert b.first_token_s is not None and len(paced) > 20
    assert paced[0] == pytest.approx(TPOT, rel=0.02)  # R measured on A's own short prompt
    starts = [0] + [i for i in range(1, len(paced)) if paced[i] < paced[i - 1]]
    worst = [max(paced[i:j]) for i, j in zip(starts, [*starts[1:], len(paced)], strict=True)]
    assert len(worst) >= 3 and worst[0] > 1.2 * TPOT  # flat: late chunks over the target
    assert all(b < a for a, b in itertools.pairwise(worst)) and worst[-1] < 1.1 * TPOT, worst
