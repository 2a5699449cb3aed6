"""The prefill chunk a worker derives from its own step trace and its TPOT target: the tokens
that fit beside its streams' decode step at its marginal prefill rate, at least one block, and
no cap before any stream decoded."""

from __future__ import annotations

from pdserve.workers.prefill_budget import marginal_prefill_rate, prefill_chunk
from pdserve.workers.step_trace import Step


def _step(at: float, seconds: float, prefill: int, decode: int) -> Step:
    return Step(at, at + seconds, prefill, decode, decode + (1 if prefill else 0), 0, 0)


def _trace() -> list[Step]:
    """Newest first: decode-only steps of 40 ms, and mixed steps of 40 ms of decode plus 64
    prompt tokens at 1,000 tokens/s (64 ms), and one prefill-only step of 200 tokens (0.2 s)."""
    steps = [_step(10.0 - i, 0.040, 0, 8) for i in range(10)]
    steps += [_step(5.0 - i, 0.104, 64, 8) for i in range(3)]
    return [*steps, _step(0.0, 0.2, 200, 0)]


def test_the_marginal_rate_leaves_out_each_mixed_steps_decode_part() -> None:
    rate = marginal_prefill_rate(_trace(), decode_step_s=0.040)
    assert abs(rate - 1000.0) < 1e-6  # (3 x 64 + 200) / (3 x 0.064 + 0.2)


def test_the_chunk_fills_what_the_decode_step_leaves_of_the_target() -> None:
    assert prefill_chunk(0.100, _trace(), block_size=16) == 60  # (0.1 - 0.04) x 1,000
    assert prefill_chunk(0.045, _trace(), block_size=16) == 16  # at least one block
    assert prefill_chunk(0.030, _trace(), block_size=16) == 16  # even past the target


def test_no_cap_before_a_stream_decoded_and_one_block_before_a_prompt_was_timed() -> None:
    assert prefill_chunk(0.1, [_step(0.0, 0.2, 200, 0)], block_size=16) is None
    assert prefill_chunk(0.1, [_step(0.0, 0.04, 0, 4)], block_size=16) == 16
