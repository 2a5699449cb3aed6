"""The elastic decision (`router/elastic.py`) on hand-built observations: which worker flips to
which role, when (sustained pressure, never within the cool-down), and when it must not (the
other side's headroom, the last worker of a role, a worker flipping or unhealthy)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

import pytest

from pdserve.router.app import add_router_args, settings_from_args
from pdserve.router.elastic import (
    FlipPlan,
    Hold,
    Memory,
    Observation,
    StageLoad,
    WorkerView,
    consider,
    decide,
    prefill_wait_s,
    stage_load,
    tally,
)
from pdserve.router.elastic_settings import ElasticSettings, elastic_to_args

S = ElasticSettings(ttft_target_s=1.0, tpot_target_s=0.1, interval_s=2.0, sustain_ticks=3,
                    cooldown_s=30.0)


def pre(key: str, backlog: int = 0, rate: float | None = 1000.0, **kw) -> WorkerView:
    """A prefill worker whose backlog is what a steady stream leaves: over the 10 s window of
    `obs` it was sent 4 prompts of the backlog's size (at 2,000 tokens, 800 tokens/s: 80% of
    its rate), unless `sent_prompts` and `sent_tokens` say."""
    arrived = {"sent_prompts": 4 if backlog else 0, "sent_tokens": 4 * backlog}
    return WorkerView(key, "prefill", kw.pop("routable", True), backlog_tokens=backlog,
                      prefill_tokens_per_s=rate, **{**arrived, **kw})


def dec(key: str, inflight: int = 0, step: float | None = 0.01, used: int = 0,
        role: str = "decode", **kw) -> WorkerView:
    return WorkerView(key, role, kw.pop("routable", True), inflight=inflight, decode_step_s=step,
                      kv_used=used, kv_total=100, prefill_tokens_per_s=500.0, **kw)


def obs(now: float, *workers: WorkerView, **kw) -> Observation:
    """With an arrival window of 10 s in which no prompt arrived, unless `window_s` says."""
    return Observation(now, tuple(workers), **{"window_s": 10.0, **kw})


def prefill_bound(now: float) -> Observation:
    """2000 tokens to prefill at 1000 tokens/s: a 2 s wait, over half the 1 s TTFT target;
    the decode workers are calm."""
    return obs(now, pre("p1", backlog=2000), dec("d1", inflight=3, used=10),
               dec("d2", inflight=1, used=5))


def decode_bound(now: float) -> Observation:
    """The decode side's KV is 90% used; the prefill workers are idle."""
    return obs(now, pre("p1", backlog=100), pre("p2"), dec("d1", used=90))


def run(observations: Iterable[Observation], memory: Memory | None = None,
        settings: ElasticSettings = S) -> list[FlipPlan | None]:
    """The plan of each tick, as the controller makes them (each plan is carried out)."""
    plans, memory = [], memory or Memory()
    for o in observations:
        memory = tally(memory, o, settings)
        plan = decide(o, memory, settings)
        if plan is not None:
            memory = memory.flipped(o.now)
        plans.append(plan)
    return plans


def test_sustained_prefill_pressure_flips_the_least_loaded_decode_worker() -> None:
    plans = run(prefill_bound(t) for t in (0.0, 2.0, 4.0))
    assert plans[:2] == [None, None]  # not before sustain_ticks observations
    assert plans[2] is not None and (plans[2].worker, plans[2].to) == ("d2", "prefill")
    assert "prefill wait ~2000 ms over 0.5 x the 1000 ms TTFT target for 3 ticks" in \
        plans[2].reason


def test_a_pressure_interrupted_starts_counting_again() -> None:
    calm = obs(4.0, pre("p1"), dec("d1"), dec("d2"))
    ticks = [prefill_bound(0.0), prefill_bound(2.0), calm, prefill_bound(6.0),
             prefill_bound(8.0)]
    assert run(ticks) == [None] * 5
    assert run([*ticks, prefill_bound(10.0)])[-1] is not None


def test_the_cool_down_follows_every_flip() -> None:
    times = [0.0, 2.0, 4.0, *(4.0 + 2 * i for i in range(1, 16))]  # up to 34 s
    plans = run(prefill_bound(t) for t in times)
    flips = [(t, p.worker) for t, p in zip(times, plans, strict=True) if p is not None]
    assert flips == [(4.0, "d2"), (34.0, "d2")]  # 30 s after the first, pressure still on


def test_a_failed_flip_starts_the_cool_down_too() -> None:
    memory = Memory(prefill_ticks=5).flipped(10.0)
    assert memory == Memory(last_flip_at=10.0)
    later = tally(tally(tally(memory, prefill_bound(12), S), prefill_bound(14), S),
                  prefill_bound(16), S)
    assert decide(prefill_bound(16.0), later, S) is None
    assert decide(prefill_bound(40.0), later, S) is not None


@pytest.mark.parametrize("workers", [
    (pre("p1", backlog=2000), dec("d1")),  # the only decode worker
    (pre("p1", backlog=2000), dec("d1"), dec("d2", routable=False)),  # the other is down
    (pre("p1", backlog=2000), dec("d1"), dec("d2", phase="draining", routable=False)),
])
def test_never_the_last_decode_capable_worker(workers: tuple[WorkerView, ...]) -> None:
    assert run(obs(t, *workers) for t in (0.0, 2.0, 4.0, 6.0)) == [None] * 4


def test_a_collocated_worker_counts_as_decode_capable() -> None:
    plans = run(obs(t, pre("p1", backlog=2000), dec("d1"), dec("c1", role="collocated"))
                for t in (0.0, 2.0, 4.0))
    assert plans[-1] is not None and (plans[-1].worker, plans[-1].to) == ("d1", "prefill")


@pytest.mark.parametrize(("d1", "d2", "kw"), [
    (dec("d1", step=0.04), dec("d2", step=0.01), {}),  # 40 ms x 2/1 = 80 ms > 0.6 x 100 ms
    (dec("d1", used=35), dec("d2", used=30), {}),  # 65 of the 100 blocks left: over 60%
    (dec("d1"), dec("d2"), {"decode_waiting": 1}),  # requests wait for a decode slot
])
def test_no_flip_to_prefill_without_decode_headroom(d1: WorkerView, d2: WorkerView,
                                                    kw: dict) -> None:
    ticks = [obs(t, pre("p1", backlog=2000), d1, d2, **kw) for t in (0.0, 2.0, 4.0, 6.0)]
    assert run(ticks) == [None] * 4
    memory = Memory(prefill_ticks=S.sustain_ticks)
    held = consider(ticks[-1], memory, S)
    assert isinstance(held, Hold) and held.pressure == "prefill"
    assert held.reason.startswith(("without d1 the decode side would be left at",
                                   "without d2 the decode side would be left at",
                                   "1 requests wait for a decode slot"))


@pytest.mark.parametrize(("decode", "kw", "why"), [
    (dec("d1", used=90), {}, "decode KV 90% used (>= 85%)"),
    (dec("d1", step=0.09), {}, "decode step 90 ms (>= 0.8 x the 100 ms TPOT target)"),
    (dec("d1"), {"decode_waiting": 4}, "4 requests wait for a decode slot"),
])
def test_sustained_decode_pressure_flips_the_least_loaded_prefill_worker(
        decode: WorkerView, kw: dict, why: str) -> None:
    ticks = [obs(t, pre("p1", backlog=100), pre("p2"), decode, **kw) for t in (0.0, 2.0, 4.0)]
    plans = run(ticks)
    assert plans[:2] == [None, None]
    assert plans[2] is not None and (plans[2].worker, plans[2].to) == ("p2", "decode")
    assert plans[2].reason == (f"{why} for 3 ticks; the prefill side keeps headroom (wait "
                               "~100 ms projected without it; at the 40 prompt tokens/s of the "
                               "last 10 s busy 4% of the time, a prompt waiting ~4 ms)")


def test_no_flip_to_decode_without_prefill_headroom() -> None:
    # 400 tokens at 2 x 1000 tokens/s: 0.2 s, no prefill pressure; on one worker 0.4 s, over
    # the quarter of the target a flip may leave
    ticks = [obs(t, pre("p1", backlog=200), pre("p2", backlog=200), dec("d1", used=90))
             for t in (0.0, 2.0, 4.0, 6.0)]
    assert run(ticks) == [None] * 4
    held = consider(ticks[-1], Memory(decode_ticks=S.sustain_ticks), S)
    assert held == Hold("decode", "without p1 a prompt would wait ~400 ms to prefill (calm: "
                                  "<= 250 ms)")


def test_a_hold_names_the_busy_fraction_the_flip_would_leave() -> None:
    """d1's decode step is past the target; p1, the last prefill worker, took 900 prompt
    tokens/s that d1 and p1 as paced decoders (500 tokens/s each) could take only 90% of the
    time: no flip, and the reason says so."""
    tick = obs(0.0, pre("p1", sent_prompts=10, sent_tokens=9000),
               dec("d1", inflight=4, step=0.09))
    held = consider(tick, Memory(decode_ticks=S.sustain_ticks), S)
    assert isinstance(held, Hold) and held.pressure == "decode"
    assert held.reason.startswith("without p1, at the 900 prompt tokens/s of the last 10 s, "
                                  "the prefill side would be busy 90% of the time")
    assert decide(tick, Memory(decode_ticks=S.sustain_ticks), S) is None
    over = obs(0.0, pre("p1", sent_prompts=10, sent_tokens=12000),
               dec("d1", inflight=4, step=0.09))
    held = consider(over, Memory(decode_ticks=S.sustain_ticks), S)
    assert isinstance(held, Hold) and "busy 120% of the time, a prompt's wait growing " \
        "without bound" in held.reason


def test_no_hold_without_a_sustained_pressure_or_within_the_cool_down() -> None:
    tick = obs(10.0, pre("p1", backlog=200), pre("p2", backlog=200), dec("d1", used=90))
    assert consider(tick, Memory(decode_ticks=S.sustain_ticks - 1), S) is None
    cooling = Memory(decode_ticks=S.sustain_ticks, last_flip_at=0.0)
    assert consider(tick, cooling, S) is None


def test_the_last_prefill_worker_flips_only_with_no_split_request() -> None:
    def tick(t: float, demand: int) -> Observation:
        return obs(t, pre("p1"), dec("d1", used=90), prefill_demand=demand)

    assert run(tick(t, 1) for t in (0.0, 2.0, 4.0, 6.0)) == [None] * 4
    plans = run(tick(t, 0) for t in (0.0, 2.0, 4.0))  # the decode worker prefills locally
    assert plans[-1] is not None and (plans[-1].worker, plans[-1].to) == ("p1", "decode")


def test_no_flip_of_a_worker_flipping_or_unhealthy() -> None:
    down = dec("d2", inflight=0, routable=False)  # the least loaded, but unhealthy
    plans = run(obs(t, pre("p1", backlog=2000), dec("d1", inflight=2), down, dec("d3", 5))
                for t in (0.0, 2.0, 4.0))
    assert plans[-1] is not None and plans[-1].worker == "d1"
    flipping = dec("d2", phase="flipping", routable=False)
    assert run(obs(t, pre("p1", backlog=2000), dec("d1"), flipping, dec("d3"))
               for t in (0.0, 2.0, 4.0, 6.0)) == [None] * 4


def test_decode_pressure_does_not_count_while_the_prefill_side_is_the_bottleneck() -> None:
    # requests wait for decode slots held by requests that wait for their prefill
    o = obs(0.0, pre("p1", backlog=2000), pre("p2", backlog=2000), dec("d1"), decode_waiting=9)
    memory = tally(tally(Memory(), o, S), o, S)
    assert (memory.prefill_ticks, memory.decode_ticks) == (2, 0)


def test_an_unmeasured_prefill_rate_is_no_pressure() -> None:
    o = obs(0.0, pre("p1", backlog=5000, rate=None), dec("d1"), dec("d2"))
    assert prefill_wait_s(o) is None
    assert run(obs(t, *o.workers) for t in (0.0, 2.0, 4.0)) == [None] * 3
    assert prefill_wait_s(obs(0.0, pre("p1", rate=None))) == 0.0  # nothing to prefill


def test_pressure_alternating_within_the_cool_down_flips_at_most_once() -> None:
    every_tick = [prefill_bound(t) if i % 2 else decode_bound(t)
                  for i, t in enumerate(2.0 * i for i in range(20))]
    assert run(every_tick) == [None] * 20  # never sustained
    # prefill pressure long enough to flip, then decode pressure, all within 30 s
    swings = [*(prefill_bound(2.0 * i) for i in range(3)),
              *(decode_bound(6.0 + 2.0 * i) for i in range(6)),
              *(prefill_bound(18.0 + 2.0 * i) for i in range(6))]
    assert [p.to for p in run(swings) if p is not None] == ["prefill"]


def test_a_flip_to_prefill_leaves_no_pressure_to_flip_back() -> None:
    """Under the load that caused it, the configuration after the flip is calm on the decode
    side: the projections kept it under the triggers."""
    after = [obs(t, pre("p1", backlog=1000), pre("d2"), dec("d1", inflight=4, used=15,
                                                            step=0.02))
             for t in range(40, 80, 2)]
    assert run(after, Memory(last_flip_at=4.0)) == [None] * 20


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


def test_router_flags(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    base = ("--secret-file", str(secret))
    assert settings_from_args(_parse(*base)).elastic is None
    elastic = settings_from_args(_parse(*base, "--elastic", "--slo-ttft-ms", "500",
                                        "--slo-tpot-ms", "50")).elastic
    assert elastic == ElasticSettings(ttft_target_s=0.5, tpot_target_s=0.05)
    assert settings_from_args(_parse(*base, "--elastic")).elastic == ElasticSettings()
    with pytest.raises(ValueError, match="--slo-ttft-ms must be a number > 0"):
        settings_from_args(_parse(*base, "--elastic", "--slo-ttft-ms", "0"))


def test_router_timing_flags(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    base = ("--secret-file", str(secret), "--elastic")
    elastic = settings_from_args(_parse(*base, "--elastic-interval-s", "0.5",
                                        "--elastic-sustain-ticks", "5",
                                        "--elastic-cooldown-s", "12")).elastic
    assert elastic == ElasticSettings(interval_s=0.5, sustain_ticks=5, cooldown_s=12.0)
    assert (elastic_to_args(elastic) == ["--elastic", "--elastic-interval-s", "0.5",
                                         "--elastic-sustain-ticks", "5",
                                         "--elastic-cooldown-s", "12.0"])
    assert elastic_to_args(ElasticSettings()) == ["--elastic"] and elastic_to_args(None) == []
    for argv, match in [(("--elastic-interval-s", "-1"), "--elastic-interval-s must be a "
                                                         "number > 0, got -1.0"),
                        (("--elastic-cooldown-s", "inf"), "--elastic-cooldown-s must be a "
                                                          "number > 0, got inf"),
                        (("--elastic-sustain-ticks", "0"), "--elastic-sustain-ticks must be "
                                                           "an integer >= 1, got 0")]:
        with pytest.raises(ValueError, match=match):
            settings_from_args(_parse(*base, *argv))
        with pytest.raises(ValueError, match=match):  # checked without --elastic too
            settings_from_args(_parse(*base[:2], *argv))


def test_timing_flags_are_in_the_elastic_section_of_help() -> None:
    p = argparse.ArgumentParser()
    add_router_args(p)
    sections = p.format_help().split("\n\n")
    elastic = next(s for s in sections if s.startswith("elastic pools"))
    for flag in ("--elastic ", "--elastic-interval-s", "--elastic-sustain-ticks",
                 "--elastic-cooldown-s"):
        assert flag in elastic


def test_an_idle_prefill_side_beside_busy_decoders_becomes_decode() -> None:
    def tick(t: float, streams: int, backlog: int = 0, demand: int = 0) -> Observation:
        return obs(t, pre("p1", backlog=backlog), dec("d1", inflight=streams),
                   prefill_demand=demand)

    plans = run(tick(t, 16) for t in (0.0, 2.0, 4.0))
    assert plans[:2] == [None, None] and plans[2] is not None
    assert (plans[2].worker, plans[2].to) == ("p1", "decode")
    assert plans[2].reason.startswith("the prefill side idle while every decode-capable worker "
                                      "streams >= 2 requests for 3 ticks")
    assert run(tick(t, 1) for t in (0.0, 2.0, 4.0, 6.0)) == [None] * 4  # one stream: no gain
    assert run(tick(t, 16, backlog=600) for t in (0.0, 2.0, 4.0, 6.0)) == [None] * 4  # busy
    assert run(tick(t, 16, demand=1) for t in (0.0, 2.0, 4.0, 6.0)) == [None] * 4  # in use


def test_a_stages_load_is_the_queueing_of_the_windows_arrivals() -> None:
    p1 = pre("p1", sent_prompts=8, sent_tokens=4000)  # 400 tokens/s over the 10 s window
    p2 = pre("p2", rate=None)  # never prefilled: counts at the mean measured rate, 750
    o = obs(0.0, p1, p2, dec("d1"))  # d1 prefills 500 tokens/s
    alone = stage_load(o, [p1], [p1])
    assert (alone.tokens_per_s, alone.rho) == (400.0, 0.4)
    assert alone.wait_s == pytest.approx(0.4 / 0.6 * 500 / 1000)  # a 500-token mean prompt
    both = stage_load(o, [p1, p2], [p1, p2])
    assert both.rho == pytest.approx(400 / 1750)
    assert both.wait_s == pytest.approx(both.rho / (1 - both.rho) * 500 / 875)
    at_d1 = stage_load(o, [dec("d1")], [p1, p2])  # 400 tokens/s on 500
    assert at_d1.rho == 0.8 and at_d1.wait_s == pytest.approx(0.8 / 0.2 * 500 / 500)
    twice = stage_load(o, [dec("d1")], [p1, pre("p3", sent_prompts=8, sent_tokens=4000)])
    assert (twice.rho, twice.wait_s) == (1.6, math.inf)  # the queue grows without bound
    assert stage_load(obs(0.0, p1, window_s=0.0), [p1], [p1]) is None  # no window yet
    unmeasured = pre("p1", rate=None, sent_prompts=1, sent_tokens=100)
    assert stage_load(obs(0.0, unmeasured), [unmeasured], [unmeasured]) is None
    assert stage_load(obs(0.0, pre("p1")), [pre("p1")], [pre("p1")]) == StageLoad(0, 0, 0)


def test_no_prefill_worker_is_taken_away_from_arrivals_the_rest_cannot_keep_up_with() -> None:
    """The prefill worker's queue is empty right now and the decode worker's too, but 600
    prompt tokens/s of 1,500-token prompts arrived at the two over the window: once p1 is a
    decode worker too, the two prefill in paced chunks at d1's measured 500 each, busy 60%
    of the time, a prompt waiting ~4.5 s. With the arrivals of a calm stream (60 tokens/s)
    the same instant flips it."""
    def tick(t: float, sent: int) -> Observation:
        return obs(t, pre("p1", sent_prompts=2, sent_tokens=sent // 2),
                   dec("d1", inflight=4, sent_prompts=2, sent_tokens=sent // 2))

    assert run(tick(t, 6000) for t in range(0, 20)) == [None] * 20
    plans = run(tick(t, 600) for t in range(0, 3))
    assert plans[-1] is not None and (plans[-1].worker, plans[-1].to) == ("p1", "decode")
    assert plans[-1].reason.endswith("(wait ~0 ms projected without it; at the 60 prompt "
                                     "tokens/s of the last 10 s busy 6% of the time, a prompt "
                                     "waiting ~19 ms)")


def test_no_flip_away_from_prefill_before_arrivals_were_measured() -> None:
    ticks = [obs(t, pre("p1"), dec("d1", inflight=8), window_s=0.0) for t in range(10)]
    assert run(ticks) == [None] * 10


def test_the_last_prefill_worker_counts_as_a_paced_decode_worker_once_flipped() -> None:
    """Once the last prefill worker p1 is a decode worker it prefills in paced chunks beside
    d1, at d1's measured 500 tokens/s: 900 prompt tokens/s would keep the two busy 90% of
    the time (over RHO_CALM): no flip; 300 tokens/s of 150-token prompts, 30%, with a ~130 ms
    wait: it flips (d1 alone, at 60%, would have been refused)."""
    def tick(t: float, sent: int) -> Observation:
        return obs(t, pre("p1", sent_prompts=10, sent_tokens=sent // 2),
                   dec("d1", inflight=4, sent_prompts=10, sent_tokens=sent // 2))

    assert run(tick(t, 9000) for t in range(0, 10)) == [None] * 10
    plans = run(tick(t, 3000) for t in range(0, 3))
    assert plans[-1] is not None and (plans[-1].worker, plans[-1].to) == ("p1", "decode")
    assert "busy 30% of the time, a prompt waiting ~129 ms" in plans[-1].reason


def test_a_backlog_the_rates_call_calm_is_no_prefill_pressure() -> None:
    """One long prompt queued on a prefill worker that gets one a minute: its wait is over
    half the TTFT target for seconds, but the stage is idle most of the time."""
    quiet = [obs(t, pre("p1", backlog=3000, sent_prompts=1, sent_tokens=3000),
                 dec("d1", inflight=1), dec("d2"), window_s=60.0) for t in range(10)]
    assert run(quiet) == [None] * 10
    assert run(obs(t, *o.workers, window_s=0.0) for t, o in enumerate(quiet))[2] is not None
