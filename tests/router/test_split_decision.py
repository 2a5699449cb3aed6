"""Conditional disaggregation from measured costs: where a prompt is prefilled."""

from __future__ import annotations

import pytest

from pdserve.router.split_decision import (
    LinkTime,
    PrefillBacklog,
    PromptTokens,
    Speed,
    decide,
    kv_bytes_per_token,
)

TPOT = 0.1
BYTES = 1000  # KV bytes per token


def _link(bytes_per_s: float, fixed_s: float = 0.0) -> list[LinkTime]:
    return [lambda nbytes: fixed_s + nbytes / bytes_per_s]


NO_LINK: list[LinkTime] = [lambda nbytes: 0.0]  # not measured: no cost


def _cold(tokens: int, prefill_workers: int = 1) -> PromptTokens:
    return PromptTokens.cold(tokens, prefill_workers)


def test_nothing_is_decided_until_a_rate_is_measured() -> None:
    assert decide(_cold(500), BYTES, Speed(None), [Speed(None)], NO_LINK, TPOT) is None


def test_an_unmeasured_worker_counts_at_the_measured_rate() -> None:
    # a prefill worker that never prefilled still gets prompts when the decode worker is busy
    busy = Speed(1000.0, decode_step_s=0.02, running=3)
    d = decide(_cold(200), BYTES, busy, [Speed(None)], NO_LINK, TPOT)
    assert not d.local and d.t_remote_s == pytest.approx(0.2)
    idle_decode = decide(_cold(200), BYTES, Speed(None), [Speed(500.0)], NO_LINK, TPOT)
    assert idle_decode.t_local_s == pytest.approx(0.4)


def test_an_idle_cluster_saves_the_transfer_and_a_decoding_worker_splits() -> None:
    idle = decide(_cold(2000), BYTES, Speed(1000.0), [Speed(1000.0)], _link(1e9), TPOT)
    assert idle.local  # 2.0 s either way, plus 2 ms of transfer when split
    assert idle.t_local_s == pytest.approx(2.0) and idle.t_remote_s == pytest.approx(2.002)
    assert idle.prefill_index == 0
    decoding = Speed(1000.0, decode_step_s=0.02, running=1)
    assert not decide(_cold(2000), BYTES, decoding, [Speed(1000.0)], _link(1e9), TPOT).local


def test_a_loaded_prefill_pool_sends_the_prompt_to_an_idle_decode_worker() -> None:
    busy = Speed(1000.0, backlog_tokens=6000)  # 6 s of queued prompts
    d = decide(_cold(1500), BYTES, Speed(800.0), [busy], _link(1e9), TPOT)
    assert d.local and d.t_local_s == pytest.approx(1.875) and d.t_remote_s > 7.5


def test_a_decode_worker_never_freezes_its_streams_past_the_target() -> None:
    busy = Speed(1000.0, backlog_tokens=6000)
    decoding = Speed(800.0, decode_step_s=0.03, running=4)  # whole prompt: 1.9 s per step
    d = decide(_cold(1500), BYTES, decoding, [busy], _link(1e9), TPOT)
    assert not d.local and "4 streams" in d.reason and "100 ms target" in d.reason
    assert d.over_tpot_target
    chunked = Speed(800.0, decode_step_s=0.03, running=4, chunk_tokens=48)  # +60 ms per step
    within = decide(_cold(1500), BYTES, chunked, [busy], _link(1e9), TPOT)
    assert within.local and not within.over_tpot_target
    # a worker that paces its chunks to a target no looser than the router's needs no check,
    # even where its measured rate (mixed steps counted whole) makes the chunk look long
    paced = Speed(200.0, decode_step_s=0.06, running=4, chunk_tokens=16, paced_tpot_s=0.1)
    assert decide(_cold(1500), BYTES, paced, [busy], _link(1e9), TPOT).local
    loose = Speed(200.0, decode_step_s=0.06, running=4, chunk_tokens=16, paced_tpot_s=0.2)
    assert not decide(_cold(1500), BYTES, loose, [busy], _link(1e9), TPOT).local


def test_a_slow_link_keeps_a_prompt_local_and_the_fastest_prefill_worker_is_named() -> None:
    prefill = [Speed(500.0), Speed(2000.0)]
    prompt = _cold(1000, 2)
    fast_link = decide(prompt, BYTES, Speed(1000.0), prefill, _link(1e9) * 2, TPOT)
    assert not fast_link.local and fast_link.prefill_index == 1
    slow_link = decide(prompt, BYTES, Speed(1000.0), prefill, _link(1e6) * 2, TPOT)  # 1 s to move
    assert slow_link.local


def test_each_prefill_worker_counts_with_its_own_link_to_the_decode_worker() -> None:
    # the decode worker is 1 s behind: either prefill worker is 0.5 s away, behind its link
    decode = Speed(1000.0, backlog_tokens=1000)
    same = [Speed(1000.0), Speed(1000.0)]
    prompt = _cold(500, 2)
    slow_first = decide(prompt, BYTES, decode, same, _link(1e6) + _link(1e9), TPOT)  # 0.5 s, 0.5 ms
    assert not slow_first.local and slow_first.prefill_index == 1
    assert slow_first.t_remote_each_s == pytest.approx((1.0, 0.5005))
    slow_second = decide(prompt, BYTES, decode, same, _link(1e9) + _link(1e6), TPOT)
    assert not slow_second.local and slow_second.prefill_index == 0
    # every link slow (a fixed 2 s, or 2 s of bytes): the prompt stays on the decode worker
    both_slow = decide(prompt, BYTES, decode, same, _link(1e9, 2.0) + _link(2.5e5), TPOT)
    assert both_slow.local and both_slow.t_local_s == pytest.approx(1.5)
    assert both_slow.t_remote_each_s == pytest.approx((2.5005, 2.5))


def test_each_path_counts_the_tokens_its_worker_lacks_and_every_link_the_whole_prompt() -> None:
    asked: list[int] = []

    def link(nbytes: int) -> float:
        asked.append(nbytes)
        return nbytes / 1e9

    # the decode worker holds all but 10 of 1,754 tokens; p0 none of them, p1 all but 10
    prompt = PromptTokens(moved=1760, local=10, remote=(1754, 10))
    d = decide(prompt, BYTES, Speed(67.0), [Speed(1000.0), Speed(1000.0)], [link, link], TPOT)
    assert set(asked) == {1760 * BYTES}  # 1,760 tokens' KV moves, whoever computes what
    assert d.t_local_s == pytest.approx(10 / 67)
    assert d.t_remote_each_s == pytest.approx((1.754 + 0.00176, 0.01 + 0.00176))
    assert not d.local and d.prefill_index == 1
    assert "U_d 10 + Q_d 0 tokens at R_d 67/s" in d.reason
    assert "prefill #1: U_p 10 + Q_p 0 tokens at R_p 1000/s + 2 ms" in d.reason
    assert "N 1760 tokens' KV (1.8 MB)" in d.reason
    only_p0 = PromptTokens(moved=1760, local=10, remote=(1754,))
    assert decide(only_p0, BYTES, Speed(67.0), [Speed(1000.0)], [link], TPOT).local


def test_the_backlog_counts_each_leg_once() -> None:
    backlog = PrefillBacklog()
    done = backlog.add("p0", 700)
    backlog.add("p0", 300)
    assert backlog.tokens("p0") == 1000 and backlog.tokens("p1") == 0
    done()
    done()
    assert backlog.tokens("p0") == 300


def test_speed_reads_the_health_report_and_ignores_nonsense() -> None:
    info = {"rates": {"prefill_tokens_per_s": 900.5, "decode_step_s": 0.02},
            "chunk_tokens": 64}
    assert Speed.of(info, 10, 2) == Speed(900.5, 0.02, 10, 2, 64)
    bad = {"rates": {"prefill_tokens_per_s": -1, "decode_step_s": "x"}, "chunk_tokens": True}
    assert Speed.of(bad, 0, 0) == Speed(None)
    assert Speed.of({}, 0, 0) == Speed(None)


def test_kv_bytes_per_token_from_the_layout() -> None:
    layout = {"num_layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}
    assert kv_bytes_per_token(layout) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token({"dtype": "nope"}) == 0
