"""The prefill chunk a worker derives from its own step trace and its TPOT target: the tokens
that fit beside its streams' decode step at its marginal prefill rate, at least one block, and
no cap before any stream decoded; a worker whose decode step alone misses the target says
so."""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace

import pytest

from pdserve.api.errors import ApiError
from pdserve.common.step_cost import DecodeCost, PromptCost, fit_decode_cost, misses_ttft
from pdserve.engine.scheduler import ChunkSite
from pdserve.throttled_log import ThrottledLog
from pdserve.workers import engine_loop
from pdserve.workers.cpu_pin import PinDone
from pdserve.workers.engine_loop import PAST_TARGET_LOG_S, EngineLoop
from pdserve.workers.prefill_budget import (
    BURST_STEPS,
    Pacer,
    decode_steps,
    marginal_prefill_rate,
    past_target,
    prompt_cost,
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
    engine = SimpleNamespace(config=SimpleNamespace(block_size=16), prefill_chunk=None,
                             chunk_site=lambda: ChunkSite(4, 0))

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


def _recorded(newest_first: list[Step]) -> StepTrace:
    trace = StepTrace(capacity=64)
    for step in reversed(newest_first):
        trace.record(step)
    return trace


def test_steps_timed_on_more_threads_are_priced_for_the_fewer_a_worker_has_now() -> None:
    """Two threads to one (a loan taken back) after the steps of `_trace`: each costs twice
    as long, decode 80 ms and 500 prompt tokens/s, so the chunk of a 200 ms step falls from
    (0.2 - 0.04) x 1,000 to (0.2 - 0.08) x 500; back on two, the steps timed on two are
    priced as timed again; steps timed on one, now on two, are kept as timed."""
    trace, pacer = _recorded(_trace()), Pacer(0.2, None, 16)
    assert pacer.chunk(trace, 20.0, 8) == 160
    pacer.cores_changed(11.0, threads_before=2, threads_now=1)
    assert pacer.chunk(trace, 20.1, 8) == 60  # read again at once, not REFRESH_S later
    pacer.cores_changed(12.0, threads_before=1, threads_now=2)
    assert pacer.chunk(trace, 20.2, 8) == 160
    pacer.cores_changed(13.0, threads_before=2, threads_now=2)  # no change: nothing read
    assert pacer.chunk(trace, 20.3, 8) == 160
    gained = Pacer(0.2, None, 16)
    gained.cores_changed(11.0, threads_before=1, threads_now=2)
    assert gained.chunk(trace, 20.0, 8) == 160


def test_the_loop_tells_its_pacer_when_the_worker_is_pinned_to_other_cores(monkeypatch) -> None:
    """A pin that took effect reaches the pacer with the threads before and after; a refused
    one (an ApiError) changes nothing."""
    calls: list[tuple[int, int]] = []
    pacer = SimpleNamespace(cores_changed=lambda at, before, now: calls.append((before, now)))
    loop = SimpleNamespace(pacer=pacer, engine=SimpleNamespace(
        config=SimpleNamespace(tensor_parallel_size=1)))
    done = PinDone((0,), threads=1, seconds=0.001, threads_before=2)
    monkeypatch.setattr(engine_loop, "pin_process", lambda cpus, tp: done)
    assert EngineLoop._pin(loop, (0,)) is done and calls == [(2, 1)]
    refused = ApiError(400, "the kernel refused cores [7]")
    monkeypatch.setattr(engine_loop, "pin_process", lambda cpus, tp: refused)
    assert EngineLoop._pin(loop, (7,)) is refused and calls == [(2, 1)]


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


PER_TOKEN_S, PER_PAIR_S = 0.5e-3, 0.2e-6  # a CPU core's SmolLM2 prompt: 0.5 ms a token, 0.2 a kpair


def _pairs(n: int, context: int) -> int:
    return n * context + n * (n + 1) // 2


def _chunk_step(at: float, n: int, context: int, per_token_s: float = PER_TOKEN_S,
                per_pair_s: float = PER_PAIR_S) -> Step:
    """A step beside 4 streams (30 ms of decode) computing n prompt tokens after `context`."""
    seconds = 0.03 + per_token_s * n + per_pair_s * _pairs(n, context)
    return Step(at, at + seconds, n, 4, 5, 0, _pairs(n, context))


def _serve(pacer: Pacer, phases: int, decode_steps: int, prompt: int, per_pair_s: float = 0.0,
           context_known: bool = True) -> tuple[list[Step], int]:
    """A worker whose 4 streams take 30 ms a decode step and whose prompts cost 1 ms a token
    (and `per_pair_s` an attended pair) beside them: `phases` times, `decode_steps` decode-only
    steps, then a `prompt`-token prompt in the chunks the pacer gives, told each chunk's context
    or not. The steps oldest first, and the prompt steps taken."""
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
        done = 0
        while done < prompt:
            chunk = pacer.chunk(trace, now, 4, done if context_known else 0)
            n = min(prompt - done, chunk or prompt)
            run(_chunk_step(now, n, done, 1e-3, per_pair_s))
            done, prompt_steps = done + n, prompt_steps + 1
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


def test_a_queue_misses_its_first_tokens_when_its_chunks_take_longer_than_the_target_leaves(
        ) -> None:
    """Prompt k has its first token after w_k + ceil(Q_k / C) steps, Q_k the tokens up to and
    including its own."""
    assert not misses_ttft([(8.5, 400)], 10.0, 100, 0.1, 2.0)  # 1.5 + 4 x 0.1
    assert misses_ttft([(8.5, 600)], 10.0, 100, 0.1, 2.0)  # 1.5 + 6 x 0.1
    assert misses_ttft([(9.9, 100), (9.5, 1700)], 10.0, 100, 0.1, 2.0)  # 0.5 + 17 x 0.1
    assert not misses_ttft([], 10.0, 100, 0.1, 2.0)


def test_a_prompt_that_would_miss_its_ttft_at_the_credits_pace_gets_steps_at_the_ceiling(
        ) -> None:
    """No credit (B = 0): a step beside the streams takes the TPOT target, 60 prompt tokens
    here, until a waiting prompt would have its first token past the TTFT target at that pace;
    then the ceiling's 260. Without a TTFT target, or without a ceiling above the target,
    nothing changes."""
    trace = StepTrace(capacity=64)
    for step in reversed(_trace()):
        trace.record(step)
    on_time, late = [(9.9, 500)], [(9.9, 500), (8.5, 1500)]
    paced = Pacer(0.1, 0.3, 16, ttft_target_s=2.0)
    assert paced.chunk(trace, 10.0, 4, 0, on_time) == 60  # 0.1 + 9 x 0.1 after 0.1 s
    assert paced.chunk(trace, 10.0, 4, 0, late) == 260  # (0.3 - 0.04) x 1,000
    assert Pacer(0.1, 0.3, 16).chunk(trace, 10.0, 4, 0, late) == 60
    assert Pacer(0.1, None, 16, ttft_target_s=2.0).chunk(trace, 10.0, 4, 0, late) == 60


def test_the_loop_reads_the_waiting_prompts_only_for_a_ttft_target() -> None:
    """With a TTFT target it passes the engine's prompt queue (a late one: the ceiling's
    chunk, 260); without one it never reads it (a step's work it need not do)."""
    trace = StepTrace(capacity=64)
    for step in reversed(_trace()):
        trace.record(step)
    reads: list[int] = []

    def prompt_queue() -> tuple[tuple[float, int], ...]:
        reads.append(1)
        return ((time.monotonic() - 1.9, 1500),)

    for pacer, chunk, read in ((Pacer(0.1, 0.3, 16, ttft_target_s=2.0), 260, 1),
                               (Pacer(0.1, 0.3, 16), 60, 0)):
        reads.clear()
        engine = SimpleNamespace(prefill_chunk=None, chunk_site=lambda: ChunkSite(4, 0),
                                 prompt_queue=prompt_queue)
        engine.set_prefill_chunk = lambda tokens, e=engine: setattr(e, "prefill_chunk", tokens)
        loop = SimpleNamespace(pacer=pacer, trace=trace, engine=engine)
        EngineLoop._refresh_prefill_chunk(loop)
        assert (engine.prefill_chunk, len(reads)) == (chunk, read)


def test_the_decode_part_grows_with_the_streams_beside_the_chunk() -> None:
    """Decode-only steps of 7 ms + 4 ms a stream, mostly one stream: s(D) is fitted, not their
    median (11 ms), so a chunk beside 6 streams leaves room for their 31 ms."""
    steps = [_step(float(i), 0.007 + 0.004 * d, 0, d) for i, d in enumerate([1] * 40 + [2, 4, 6])]
    decode = fit_decode_cost(decode_steps(steps[::-1]))
    assert (decode.fixed_s, decode.per_stream_s) == (pytest.approx(0.007), pytest.approx(0.004))
    assert step_rates(steps[::-1]).decode_step_s == pytest.approx(0.011)
    trace = StepTrace(capacity=64)
    for step in [*steps, _step(50.0, 0.011 + 0.1, 100, 1)]:  # 100 prompt tokens: 1 ms each
        trace.record(step)
    pacer = Pacer(0.1, None, 16)
    assert pacer.chunk(trace, 0.0, streams=1) == 89  # (0.1 - 0.011) / 1 ms
    assert pacer.chunk(trace, 0.0, streams=6) == 69  # (0.1 - 0.031) / 1 ms
    alike = [_step(float(i), 0.02 + 0.001 * (i % 3), 0, 4) for i in range(9)]
    one_batch = fit_decode_cost(decode_steps(alike))  # one batch size: the median
    assert one_batch.fixed_s == pytest.approx(0.021)
    assert one_batch.per_stream_s == 0.0


def test_the_prompt_cost_separates_tokens_from_attended_pairs() -> None:
    steps = [_chunk_step(float(i), n, c) for i, (n, c) in
             enumerate([(300, 0), (300, 300), (300, 600), (200, 900), (512, 0), (400, 512)])]
    cost = prompt_cost(steps[::-1], DecodeCost(0.03))
    assert cost.per_token_s == pytest.approx(PER_TOKEN_S)
    assert cost.per_pair_s == pytest.approx(PER_PAIR_S)


def test_a_fit_on_short_prompts_is_not_stretched_over_a_long_one() -> None:
    """Beyond the widest span its steps attended to (S = max P / N), a chunk is priced at S: a
    pair cost learnt on short prompts does not shrink a long prompt's late chunks without
    bound."""
    steps = [_chunk_step(float(i), n, c) for i, (n, c) in
             enumerate([(100, 0), (60, 100), (120, 0), (40, 160)])]
    cost = prompt_cost(steps, DecodeCost(0.03))
    assert cost.per_pair_s == pytest.approx(PER_PAIR_S)
    assert cost.widest_span == pytest.approx(max(s.prefill_attention / s.prefill_tokens
                                                 for s in steps))
    flat = math.floor(0.25 / (PER_TOKEN_S + PER_PAIR_S * cost.widest_span))
    assert cost.chunk(0.25, 5000) == flat == cost.chunk(0.25, 50_000)
    assert cost.chunk(0.05, 0) > math.floor(0.05 / (PER_TOKEN_S + PER_PAIR_S * cost.widest_span))


def test_steps_that_cannot_tell_pairs_apart_fall_back_on_the_flat_rate() -> None:
    """Chunks all alike (or traces without pairs): one over the marginal rate R."""
    alike = [_chunk_step(float(i), 256, 0) for i in range(5)]
    cost = prompt_cost(alike, DecodeCost(0.03))
    assert cost.per_pair_s == 0.0
    assert 1 / cost.per_token_s == pytest.approx(marginal_prefill_rate(alike, 0.03))
    assert prompt_cost([_step(0.0, 0.04, 0, 4)], DecodeCost(0.04)) is None


def test_a_chunk_is_the_most_tokens_whose_tokens_and_pairs_fit_the_time() -> None:
    cost = PromptCost(PER_TOKEN_S, PER_PAIR_S)
    for context in (0, 500, 1125):
        n = cost.chunk(0.25, context)
        spent = PER_TOKEN_S * n + PER_PAIR_S * _pairs(n, context)
        more = PER_TOKEN_S * (n + 1) + PER_PAIR_S * _pairs(n + 1, context)
        assert spent <= 0.25 < more, context
    assert cost.chunk(0.25, 1125) < cost.chunk(0.25, 0)
    assert PromptCost(1e-3).chunk(0.06, 4000) == 60  # no pair term: (a - s) x R
    assert cost.chunk(0.0, 0) == 0 and cost.chunk(-0.1, 0) == 0


def test_late_chunks_of_a_long_prompt_are_smaller_so_no_gap_passes_the_ceiling() -> None:
    """Priced at their context, the chunks of the last two prompts (the first two taught the
    pacer the cost at every context) keep every step within L = 300 ms; priced as if each
    started a prompt, the late ones overrun it."""
    known, _ = _serve(Pacer(0.1, 0.3, 16), 4, 40, 1500, PER_PAIR_S, context_known=True)
    blind, _ = _serve(Pacer(0.1, 0.3, 16), 4, 40, 1500, PER_PAIR_S, context_known=False)
    later = len(known) // 2
    assert max(s.end - s.start for s in known[later:]) <= 0.3 + 1e-9
    assert max(s.end - s.start for s in blind[later:]) > 0.32
    chunks = [(s.prefill_tokens, _context(s)) for s in known[later:] if s.prefill_tokens]
    assert max(n for n, c in chunks if c >= 800) < min(n for n, c in chunks if c == 0)


def _context(step: Step) -> int:
    """The tokens a chunk step's prompt tokens came after, from its pairs."""
    n = step.prefill_tokens
    return (step.prefill_attention - n * (n + 1) // 2) // n
