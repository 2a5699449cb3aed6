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


def test_a_chunk_is_priced_where_it_falls_in_its_prompt():
    """Prompt steps priced 0.65 ms a token and 0.13 us an attended pair beside streams whose
    decode step is 15 ms: a step's chunk is the longest that fits the 85 ms left, longer at a
    prompt's start than 1,400 tokens in, while the reported C stays the one-rate chunk."""
    pacer = ChunkPacer(0.1, 16)
    for _ in range(4):
        pacer.record(0, 2, 0.015)
    for chunk in (96, 110):
        for computed in range(0, 1500, chunk):
            n = min(chunk, 1500 - computed)
            pairs = n * computed + n * (n + 1) // 2
            pacer.record(n, 2, 0.015 + 6.5e-4 * n + 1.3e-7 * pairs, pairs)
    first, late = pacer.tokens(0.0, 0), pacer.tokens(0.0, 1400)
    assert 6.5e-4 * first + 1.3e-7 * first * (first + 1) / 2 <= 0.085
    assert 6.5e-4 * (first + 1) + 1.3e-7 * (first + 1) * (first + 2) / 2 > 0.085
    assert first > pacer.chunk(0.0) > late


def test_without_time_left_beside_the_streams_every_chunk_is_the_block():
    pacer = ChunkPacer(0.02, 16)
    pacer.record(0, 8, 0.030)
    pacer.record(1000, 0, 0.5, 500_500)
    assert pacer.tokens(0.0, 0) == pacer.tokens(0.0, 900) == 16
