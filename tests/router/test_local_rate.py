"""The rate a prompt gets on the decode worker in the split decision: from the worker's
reported marginal prefill rate R_m and what runs there now (alone: R_m; beside streams:
C / (s + C / R_m)), else its reported average, else the pool's mean."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.router.split_decision import LinkTime, PromptTokens, Speed, decide

TPOT = 0.1
BYTES = 1000  # KV bytes per token
LINK: list[LinkTime] = [lambda nbytes: nbytes / 1e9]


def _health(average: Any, marginal: Any = None, decode_step_s: Any = 0.04,
            chunk_tokens: Any = None, chunk_tpot_s: Any = None) -> dict[str, Any]:
    """A worker's signed /health details as `Speed.of` reads them (R_m left out when None)."""
    rates = {"prefill_tokens_per_s": average, "decode_step_s": decode_step_s}
    if marginal is not None:
        rates["prefill_marginal_tokens_per_s"] = marginal
    return {"rates": rates, "chunk_tokens": chunk_tokens, "chunk_tpot_s": chunk_tpot_s}


def test_an_idle_decode_worker_counts_at_its_marginal_rate_not_its_stale_average() -> None:
    # its average, 39/s, is left from 16-token chunks beside streams long gone; alone it
    # prefills at 67/s; the prefill worker, as fast, has 160 tokens queued
    d = Speed.of(_health(39.0, 67.0, chunk_tokens=16, chunk_tpot_s=0.1), 0, 0)
    assert d.prefill_marginal_tokens_per_s == 67.0
    prefill = [Speed(67.0, backlog_tokens=160)]
    decision = decide(PromptTokens.cold(320, 1), BYTES, d, prefill, LINK, TPOT)
    assert decision is not None and decision.local
    assert decision.t_local_s == pytest.approx(320 / 67)  # 4.78 s, not 320 / 39 = 8.2 s
    assert decision.t_remote_s == pytest.approx(480 / 67 + 320 * BYTES / 1e9)
    assert "U_d 320 + Q_d 0 tokens at R_d 67/s (R_m, no leg open)" in decision.reason


def test_beside_streams_a_paced_worker_counts_its_chunk_and_the_decode_step() -> None:
    # 3 legs open, 40 ms decode step, chunks of 32 paced to 100 ms, R_m 800/s: each step
    # carries 32 prompt tokens in 40 + 40 ms, so the prompt goes at 32 / 0.08 = 400/s
    d = Speed.of(_health(500.0, 800.0, chunk_tokens=32, chunk_tpot_s=0.1), 80, 3)
    decision = decide(PromptTokens.cold(320, 1), BYTES, d, [Speed(800.0)], LINK, TPOT)
    assert decision is not None
    assert decision.t_local_s == pytest.approx((80 + 320) / (32 / (0.04 + 32 / 800)))  # 1.0 s
    assert not decision.local  # 0.4 s + 0.3 ms split
    assert "at R_d 400/s (C 32 / (s 40 ms + C / R_m 800/s), 3 legs open)" in decision.reason
    # a prompt shorter than the chunk is one step: s + U / R_m
    short = decide(PromptTokens.cold(16, 1), BYTES, d, [Speed(800.0)], LINK, TPOT)
    assert short is not None
    assert short.t_local_s == pytest.approx(80 / (16 / 0.06) + 0.04 + 16 / 800)


def test_without_pacing_the_whole_prompt_is_one_step_beside_the_streams() -> None:
    # R_d = U / (s + U / R_m) = 320 / (0.04 + 0.4): the prompt's own 0.4 s after the decode
    d = Speed.of(_health(500.0, 800.0), 0, 2)
    decision = decide(PromptTokens.cold(320, 1), BYTES, d, [Speed(800.0, backlog_tokens=400)],
                      LINK, 0.45)
    assert decision is not None
    assert decision.t_local_s == pytest.approx(0.04 + 320 / 800)
    # the stall is the prompt's own part, C / R_m: 40 + 400 ms stays within 450 ms
    assert decision.local and not decision.over_tpot_target
    over = decide(PromptTokens.cold(320, 1), BYTES, d, [Speed(800.0)], LINK, 0.43)
    assert over is not None and over.over_tpot_target and not over.local


def test_a_worker_without_the_marginal_rate_counts_as_before() -> None:
    prompt = PromptTokens.cold(320, 1)
    old = Speed.of(_health(39.0, chunk_tokens=16, chunk_tpot_s=0.1), 0, 0)
    assert old.prefill_marginal_tokens_per_s is None
    decision = decide(prompt, BYTES, old, [Speed(67.0, backlog_tokens=160)], LINK, TPOT)
    assert decision is not None and not decision.local
    assert decision.t_local_s == pytest.approx(320 / 39)
    assert "at R_d 39/s (its average, no R_m reported)" in decision.reason
    # nonsense counts as not reported, and with no rate at all: the pool's mean
    for bad in (-1, 0, "x", True, float("inf"), float("nan")):
        assert Speed.of(_health(None, bad), 0, 0) == Speed(None, 0.04)
    pool = [Speed(500.0), Speed(300.0)]
    unmeasured = decide(PromptTokens.cold(320, 2), BYTES, Speed(None), pool, LINK * 2, TPOT)
    assert unmeasured is not None and unmeasured.t_local_s == pytest.approx(320 / 400)
    assert "at R_d 400/s (the pool's mean, no rate reported)" in unmeasured.reason
