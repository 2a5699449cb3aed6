"""A simulated decode worker's chunk beside its streams, as the worker sets it: C = max(block,
floor((tpot - s) x R)) from its own recent steps, refreshed every REFRESH_S."""

from __future__ import annotations

import pytest

from pdserve.planner.simulate.chunk_pacer import BURST_STEPS, REFRESH_S, ChunkPacer
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.step_window import WINDOW
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.simulate.test_events import gaps
from tests.planner.simulate.test_prefix_cache import LINEAR, linear_cluster


def test_no_cap_before_a_decode_step_and_one_block_before_a_prompt_step():
    pacer = ChunkPacer(0.1, 16)
    assert pacer.chunk(0.0) is None
    pacer.record(0, 4, 0.020)
    assert pacer.chunk(REFRESH_S) == 16


def test_the_chunk_is_the_target_left_by_a_decode_step_at_the_marginal_rate():
    """s = 20 ms; a whole prompt of 1000 tokens in 0.5 s and a mixed step of 100 tokens in
    70 ms (50 ms of it the prompt's): R = 1100 / 0.55 = 2000 tok/s, C = 0.08 x 2000 = 160."""
    pacer = ChunkPacer(0.1, 16)
    for _ in range(3):
        pacer.record(0, 4, 0.020)
    pacer.record(1000, 0, 0.5)
    pacer.record(100, 4, 0.070)
    assert pacer.chunk(0.0) == 160


def test_the_chunk_holds_between_refreshes_and_follows_the_newest_window():
    pacer = ChunkPacer(0.1, 16)
    pacer.record(0, 1, 0.020)
    pacer.record(1000, 0, 0.5)
    assert pacer.chunk(1.0) == 160
    for _ in range(WINDOW):
        pacer.record(100, 1, 0.120)  # slower prompt steps: R = 100 / 0.1 = 1000 tok/s
    assert pacer.chunk(1.0 + REFRESH_S / 2) == 160  # not refreshed yet
    assert pacer.chunk(1.0 + REFRESH_S) == 80  # the 1000-token step left the window


def test_a_decode_step_at_the_target_still_computes_a_block():
    pacer = ChunkPacer(0.02, 16)
    pacer.record(0, 8, 0.030)
    pacer.record(1000, 0, 0.5)
    assert pacer.chunk(0.0) == 16


def test_a_ceiling_lets_the_chunk_spend_what_decode_steps_left_of_the_target():
    """As the worker's pacer (workers/prefill_budget.py): the steps that decoded leave credit
    (0.1 - d each; the whole prompt alone leaves none), a step may take min(L, 0.1 + credit),
    and the credit spent comes back to the target's chunk."""
    pacer = ChunkPacer(0.1, 16, itl_target_s=0.3)
    for _ in range(3):
        pacer.record(0, 4, 0.020)  # 3 x 0.08
    pacer.record(1000, 0, 0.5)
    pacer.record(100, 4, 0.070)  # + 0.03: 0.27 s of credit
    assert pacer.chunk(0.0) == 560  # s = 20 ms, R = 2000 tok/s: (0.3 - 0.02) x 2000
    for _ in range(2 * BURST_STEPS):
        pacer.record(560, 4, 0.300)  # 0.2 s past the target each: a debt, held at -B_max
    assert pacer.credit_s == pytest.approx(-BURST_STEPS * 0.2)
    assert pacer.chunk(0.1) == 160  # the target's chunk again: (0.1 - 0.02) x 2000


def test_a_simulated_decode_worker_with_a_ceiling_prefills_its_local_prompts_sooner():
    """Two streams decode (10 ms steps on the linear machine, 1 ms a prompt token) while three
    1,500-token prompts arrive, all prefilled on the decode worker: within the 100 ms target
    each takes 17 steps of 90 tokens, each step paying the streams' 10 ms; with a 300 ms
    ceiling, 6 of up to 290, and the streams' gaps reach past the target but not the ceiling,
    their mean still far within it."""
    trace = [TraceRequest(0.0, 100, 1500)] * 2 + [TraceRequest(t, 1500, 2) for t in (3, 8, 13)]
    ttfts, worst = {}, {}
    for itl in (None, 0.3):
        c = linear_cluster(decode_workers=1, split=SplitRule.LOCAL, tpot_target_s=0.1,
                           itl_target_s=itl)
        records = sorted(simulate("disagg", c, LINEAR, trace, trace_tokens=True).records,
                         key=lambda r: r.index)
        ttfts[itl] = [r.first_token_s - r.arrival_s for r in records[2:]]
        stream = gaps(records[0])
        worst[itl] = max(stream)
        assert sum(stream) / len(stream) < 0.02
    assert all(a < b - 0.05 for a, b in zip(ttfts[0.3], ttfts[None], strict=True)), ttfts
    assert worst[None] <= 0.1 + 1e-9 < 0.2 < worst[0.3] <= 0.3 + 1e-9


def test_the_chunk_leaves_room_for_the_decode_step_of_the_streams_beside_it():
    """Decode-only steps of 7 ms + 4 ms a stream, mostly one stream (median 11 ms): beside 6
    streams the chunk leaves their 31 ms, not the median's 11 (1 ms a prompt token)."""
    pacer = ChunkPacer(0.1, 16)
    for d in [1] * 40 + [2, 4, 6]:
        pacer.record(0, d, 0.007 + 0.004 * d)
    pacer.record(100, 1, 0.011 + 0.1)
    assert pacer.chunk(0.0, streams=1) == 89
    assert pacer.chunk(0.0, streams=6) == 69
    assert pacer.chunk_of(pacer.steps.rates()) == 89  # the router's count: the median step


def test_a_prompt_that_would_miss_its_ttft_gets_the_ceilings_chunk():
    """As the worker's pacer: with the bucket spent a step takes the target, (0.1 - 0.02) x
    2000 = 160 tokens, until a waiting prompt would have its first token past the TTFT target
    at that pace (1.0 s waited + 10 steps of 0.1 s > 1.5 s); then the ceiling's 560."""
    pacer = ChunkPacer(0.1, 16, itl_target_s=0.3, ttft_target_s=1.5)
    for _ in range(3):
        pacer.record(0, 4, 0.020)
    pacer.record(1000, 0, 0.5)
    pacer.record(100, 4, 0.070)
    pacer.credit_s = 0.0  # spent on earlier chunks
    assert pacer.chunk(5.0, 4, 0, [(4.9, 800)]) == 160
    assert pacer.chunk(5.0, 4, 0, [(4.9, 800), (4.0, 1600)]) == 560
