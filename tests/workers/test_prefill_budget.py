"""The prefill chunk a worker derives from its own step trace and its TPOT target: the tokens
that fit beside its streams' decode step at its marginal prefill rate, at least one block, and
no cap before any stream decoded; a worker whose decode step alone misses the target says
so."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pdserve.throttled_log import ThrottledLog
from pdserve.workers.engine_loop import PAST_TARGET_LOG_S, EngineLoop
from pdserve.workers.prefill_budget import marginal_prefill_rate, past_target, prefill_chunk
from pdserve.workers.step_trace import Step, StepTrace


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


def test_a_decode_step_at_or_over_the_target_is_past_it() -> None:
    assert past_target(0.100, _trace()) is None  # 40 ms steps
    assert past_target(0.040, _trace()) == pytest.approx(0.040)
    assert past_target(0.030, _trace()) == pytest.approx(0.040)
    assert past_target(0.010, [_step(0.0, 0.2, 200, 0)]) is None  # no stream decoded yet


def test_a_worker_past_its_target_says_so_once_a_minute(caplog) -> None:
    """Its operator is told why its local prompts crawl at a block a step, and what meets the
    target; not at every chunk refresh."""
    trace = StepTrace(capacity=64)
    for step in reversed(_trace()):
        trace.record(step)
    chunks: list[int | None] = []
    engine = SimpleNamespace(config=SimpleNamespace(block_size=16),
                             set_prefill_chunk=chunks.append)
    loop = SimpleNamespace(tpot_target_s=0.030, _chunk_at=0.0, trace=trace, engine=engine,
                           _warnings=ThrottledLog(logging.getLogger("pdserve.worker"),
                                                  PAST_TARGET_LOG_S))
    with caplog.at_level(logging.WARNING, logger="pdserve.worker"):
        for _ in range(3):
            loop._chunk_at = 0.0  # a refresh is due
            EngineLoop._refresh_prefill_chunk(loop)
    assert chunks == [16, 16, 16]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert warned[0].startswith("decode steps take 40 ms (median), at or over the 30 ms TPOT "
                                "target (--slo-tpot-ms)")
    assert "one block (16 tokens) a step" in warned[0]
