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
from pdserve.workers.prefill_budget import (
    BURST_STEPS,
    Pacer,
    marginal_prefill_rate,
    past_target,
    step_allowance,
)
from pdserve.workers.step_rates import step_rates
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


def prefill_chunk(tpot_target_s: float, newest_first: list[Step], block_size: int
                  ) -> int | None:
    """The chunk a worker paced to `tpot_target_s` sets after these steps."""
    trace = StepTrace(capacity=64)
    for step in reversed(newest_first):
        trace.record(step)
    return Pacer(tpot_target_s, None, block_size).chunk(trace, now=0.0)


def test_the_chunk_fills_what_the_decode_step_leaves_of_the_target() -> None:
    assert prefill_chunk(0.100, _trace(), block_size=16) == 60  # (0.1 - 0.04) x 1,000
    assert prefill_chunk(0.045, _trace(), block_size=16) == 16  # at least one block
    assert prefill_chunk(0.030, _trace(), block_size=16) == 16  # even past the target


def test_no_cap_before_a_stream_decoded_and_one_block_before_a_prompt_was_timed() -> None:
    assert prefill_chunk(0.1, [_step(0.0, 0.2, 200, 0)], block_size=16) is None
    assert prefill_chunk(0.1, [_step(0.0, 0.04, 0, 4)], block_size=16) == 16


def test_a_decode_step_at_or_over_the_target_is_past_it() -> None:
    s = step_rates(_trace()).decode_step_s
    assert past_target(0.100, s) is None  # 40 ms steps
    assert past_target(0.040, s) == pytest.approx(0.040)
    assert past_target(0.030, s) == pytest.approx(0.040)
    none = step_rates([_step(0.0, 0.2, 200, 0)]).decode_step_s
    assert past_target(0.010, none) is None  # no stream decoded yet


def test_a_worker_past_its_target_says_so_once_a_minute(caplog) -> None:
    """Its operator is told why its local prompts crawl at a block a step, and what meets the
    target; not at every chunk refresh."""
    trace = StepTrace(capacity=64)
    for step in reversed(_trace()):
        trace.record(step)
    chunks: list[int | None] = []
    engine = SimpleNamespace(config=SimpleNamespace(block_size=16), prefill_chunk=None)

    def set_prefill_chunk(tokens: int | None) -> None:
        chunks.append(tokens)
        engine.prefill_chunk = tokens

    engine.set_prefill_chunk = set_prefill_chunk
    loop = SimpleNamespace(pacer=Pacer(0.030, None, 16), trace=trace, engine=engine,
                           _warnings=ThrottledLog(logging.getLogger("pdserve.worker"),
                                                  PAST_TARGET_LOG_S))
    with caplog.at_level(logging.WARNING, logger="pdserve.worker"):
        for _ in range(3):
            EngineLoop._refresh_prefill_chunk(loop)
    assert chunks == [16]  # set once: it did not change
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert warned[0].startswith("decode steps take 40 ms (median), at or over the 30 ms TPOT "
                                "target (--slo-tpot-ms)")
    assert "one block (16 tokens) a step" in warned[0]


def test_without_a_ceiling_every_step_is_allowed_the_tpot_target() -> None:
    pacer = Pacer(0.1, None, 16)
    for step in _decoding([0.02] * 32):
        pacer.observe(step)
    assert (pacer.burst_s, pacer.credit_s) == (0.0, 0.0)
    assert step_allowance(0.1, 0.1, pacer.credit_s) == 0.1


def _decoding(seconds: list[float]) -> list[Step]:
    """Decode-only steps of these durations, oldest first."""
    return [_step(float(i), d, 0, 4) for i, d in enumerate(seconds)]


def test_the_credit_is_what_the_gaps_left_of_the_target_within_bursts_of_the_ceiling() -> None:
    """B gains TPOT - d a decoding step, within +-B_max = BURST_STEPS x (L - TPOT); a step
    may take min(L, TPOT + B)."""
    pacer = Pacer(0.1, 0.3, 16)
    assert pacer.burst_s == pytest.approx(BURST_STEPS * 0.2)
    for step in _decoding([0.04] * 3):
        pacer.observe(step)
    assert pacer.credit_s == pytest.approx(0.18)
    assert step_allowance(0.1, 0.3, pacer.credit_s) == pytest.approx(0.28)
    pacer.observe(_step(10.0, 1.0, 500, 0))  # a prompt alone: no stream waited
    assert pacer.credit_s == pytest.approx(0.18)
    for step in _decoding([0.03] * 100):
        pacer.observe(step)
    assert pacer.credit_s == pytest.approx(pacer.burst_s)  # capped
    assert step_allowance(0.1, 0.3, pacer.credit_s) == 0.3
    for step in _decoding([0.5] * 100):
        pacer.observe(step)
    assert pacer.credit_s == pytest.approx(-pacer.burst_s)  # a debt, forgotten beyond B_max
    assert step_allowance(0.1, 0.3, pacer.credit_s) == 0.1  # never below the target


def _serve(pacer: Pacer, phases: int, decode_steps: int, prompt: int) -> tuple[list[Step], int]:
    """A worker whose 4 streams take 30 ms a decode step and whose prompts run at 1,000 tokens/s
    beside them: `phases` times, `decode_steps` decode-only steps, then a `prompt`-token prompt
    in the chunks the pacer gives. The steps oldest first, and the prompt steps taken."""
    trace, now, steps, prompt_steps = StepTrace(capacity=4096), 0.0, [], 0

    def run(step: Step) -> None:
        nonlocal now
        steps.append(step)
        trace.record(step)
        pacer.observe(step)
        now = step.end

    for _ in range(phases):
        for _ in range(decode_steps):
            run(_step(now, 0.03, 0, 4))
        left = prompt
        while left:
            n = min(left, pacer.chunk(trace, now) or left)
            run(_step(now, 0.03 + n / 1000.0, n, 4))
            left, prompt_steps = left - n, prompt_steps + 1
    return steps, prompt_steps


@pytest.mark.parametrize("decode_steps", [5, 40])
def test_a_paced_worker_keeps_every_gap_within_the_ceiling_and_any_run_of_gaps_within_a_burst(
        decode_steps: int) -> None:
    """The closed loop, with prompts arriving often (5 decode steps between them) or seldom
    (40): any k consecutive gaps last at most k x TPOT + B_max, and none longer than L."""
    pacer = Pacer(0.1, 0.3, 16)
    steps, _ = _serve(pacer, phases=8, decode_steps=decode_steps, prompt=1500)
    gaps = [s.end - s.start for s in steps]
    assert max(gaps) <= 0.3 + 1e-9
    for k in (1, 8, 32, 96, len(gaps)):
        worst = max(sum(gaps[i:i + k]) for i in range(len(gaps) - k + 1))
        assert worst <= k * 0.1 + pacer.burst_s + 1e-9, k


def test_cheap_steps_before_a_prompt_let_it_prefill_in_fewer_longer_chunks() -> None:
    """Without the ceiling each step beside the streams carries (0.1 - 0.03) x 1,000 = 70
    prompt tokens; with it, up to 270 while the credit that the decode steps earned lasts."""
    _, ceiling = _serve(Pacer(0.1, 0.3, 16), phases=8, decode_steps=40, prompt=1500)
    _, target = _serve(Pacer(0.1, None, 16), phases=8, decode_steps=40, prompt=1500)
    assert target >= 8 * 22  # 1,500 / 70 each (the first from one block: no R measured yet)
    assert ceiling <= target / 2
