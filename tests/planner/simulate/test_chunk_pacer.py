"""A simulated decode worker's chunk beside its streams, as the worker sets it: C = max(block,
floor((tpot - s) x R)) from its own recent steps, refreshed every REFRESH_S."""

from __future__ import annotations

from pdserve.planner.simulate.chunk_pacer import REFRESH_S, ChunkPacer
from pdserve.planner.simulate.step_window import WINDOW


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
