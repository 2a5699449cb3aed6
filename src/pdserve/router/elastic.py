"""Elastic pools: whether one worker should change role now, from one observation of the pools
and the controller's memory. Pure: no clock, no I/O (`elastic_controller.py` observes, keeps
the memory and flips through `RoleFlips`, the admin endpoint's path).

Quantities, per observation (`Observation`, built each tick):

    S        the prefill stage: the routable prefill workers; with none, the routable
             decode-capable (decode, collocated) workers, which then prefill every prompt
    Q_w      prompt tokens sent to w whose prefill has not ended (the dispatcher's backlog)
    N_q      prompt tokens of the split requests waiting for a prefill slot
    R_w      w's measured prefill rate, tokens/s (its signed /health `rates`); unmeasured
             workers add no rate
    W(S)     = (sum_{w in S} Q_w + N_q) / sum_{w in S} R_w
             the expected wait of a new prompt before its prefill starts (0 with no tokens;
             unknown with tokens and no measured rate)
    D        the routable decode-capable workers; D_q requests waiting for a decode slot
    K(D)     = sum_{w in D} kv_used / sum_{w in D} kv_total, the KV use of the decode side
    s(D)     the slowest measured decode-only step in D (the floor of its streams' ITL)

Prefill pressure: W(S) > PREFILL_HIGH x TTFT. Decode pressure, when there is no prefill
pressure (a decode queue may only be requests held up by the prefill side): D_q > 0, or
K(D) >= KV_HIGH, or s(D) >= STEP_HIGH x TPOT. An idle prefill side: prefill workers with
W(S) <= PREFILL_CALM x TTFT while every routable decode-capable worker has at least
BUSY_STREAMS legs in flight (the targets are met, but a prefill worker's core waits for prompts
that the decode workers' paced local prefills could take, while every stream shares the decode
cores). The memory counts the ticks each was seen in a row (`tally`).

Rules (`decide`), at most one flip per tick:
- none within `cooldown_s` of the last flip attempt, nor while any worker is flipping or
  draining; only routable workers (healthy, in no phase) are ever chosen;
- decode -> prefill after `sustain_ticks` of prefill pressure, flipping the routable decode
  worker with the fewest legs in flight (its drain is the shortest; then the least KV), when
  the decode side keeps headroom without it (D' = D minus that worker): D' is not empty,
  D_q = 0, and the projections
      K' = sum_{D} kv_used / sum_{D'} kv_total               <= KV_CALM
      s' = s(D) x |D| / |D'|                                 <= STEP_CALM x TPOT
  (its streams' load spread over the others; step time proportional to the batch is the
  bound: a step is at most linear in its streams);
- prefill -> decode after `sustain_ticks` of decode pressure, or of an idle prefill side,
  flipping the routable prefill worker with the smallest backlog (then the fewest legs), when
  the prefill side keeps headroom without it (S' = S minus that worker, or D when no prefill
  worker is left):
      W' = (sum_{S u S'} Q_w + N_q) / sum_{S'} R_w           <= PREFILL_CALM x TTFT
  and, if it is the last prefill worker, no split request holds or waits for a prefill slot.

Hysteresis: each flip's projection must land inside the calm band of the pressure it could
create (K' <= KV_CALM < KV_HIGH, s' <= STEP_CALM x TPOT < STEP_HIGH x TPOT, W' <=
PREFILL_CALM x TTFT < PREFILL_HIGH x TTFT), so under a steady load a flip never produces the
pressure that would flip the worker back; noise is absorbed by `sustain_ticks` and the
cool-down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.router.elastic_settings import ElasticSettings

DECODE_CAPABLE = ("decode", "collocated")
# The queueing wait alone is only part of TTFT (then the prefill itself, the KV transfer, the
# decode worker's step): at half the target the requests arriving now are about to break it,
# and the flip itself (draining the decode worker) takes time before it helps.
PREFILL_HIGH = 0.5
# Half the trigger: after taking a prefill worker away the wait must stay well inside it, so a
# few more prompts do not call for the worker back.
PREFILL_CALM = 0.25
# The measured decode step is the floor of the streams' ITL; at 80% of the target one
# interleaved prefill or a few more streams break it.
STEP_HIGH = 0.8
# Below STEP_HIGH by the margin a flip's projection needs (s' <= 0.6 keeps 25% from the trigger).
STEP_CALM = 0.6
# Above this the admission caps (KV / mean request) queue decode legs and new reservations wait
# for room, running down their KV leases.
KV_HIGH = 0.85
# Room for the streams of the worker taken away, with a quarter of the pool to spare.
KV_CALM = 0.6
# Legs in flight on every decode-capable worker for the prefill side's idleness to count: the
# streams would spread over one more decode worker (one stream alone gains nothing from it).
BUSY_STREAMS = 2


@dataclass(frozen=True)
class WorkerView:
    """One worker as observed: its role, state and load."""

    key: str
    role: str
    routable: bool  # healthy and in no phase
    phase: str | None = None  # flipping, draining
    inflight: int = 0  # legs the router has open on it
    backlog_tokens: int = 0  # Q_w
    prefill_tokens_per_s: float | None = None  # R_w
    decode_step_s: float | None = None
    kv_used: int = 0
    kv_total: int = 0


@dataclass(frozen=True)
class Observation:
    now: float  # monotonic seconds
    workers: tuple[WorkerView, ...]
    prefill_waiting_tokens: int = 0  # N_q
    prefill_demand: int = 0  # split requests holding or waiting for a prefill slot
    decode_waiting: int = 0  # D_q

    def routable(self, *roles: str) -> list[WorkerView]:
        return [w for w in self.workers if w.routable and w.role in roles]


@dataclass(frozen=True)
class Memory:
    """What the controller remembers between ticks."""

    prefill_ticks: int = 0  # consecutive ticks with prefill pressure
    decode_ticks: int = 0  # consecutive ticks with decode pressure
    idle_ticks: int = 0  # consecutive ticks with an idle prefill side beside busy decoders
    last_flip_at: float | None = None  # when the last flip attempt ended

    def flipped(self, now: float) -> Memory:
        """After a flip attempt: the cool-down starts and the pressures are counted anew."""
        return Memory(last_flip_at=now)


@dataclass(frozen=True)
class FlipPlan:
    worker: str
    to: str
    reason: str


def prefill_wait_s(obs: Observation, without: str | None = None) -> float | None:
    """W: the expected wait at the prefill stage (S, or S' without worker `without`); None
    when there are tokens to prefill and no measured rate."""
    stage = _stage(obs, without)
    counted = {w.key: w for w in [*_stage(obs, None), *stage]}
    tokens = sum(w.backlog_tokens for w in counted.values()) + obs.prefill_waiting_tokens
    if tokens <= 0:
        return 0.0
    rate = sum(w.prefill_tokens_per_s or 0.0 for w in stage)
    return tokens / rate if rate > 0 else None


def decode_pressure(obs: Observation, s: ElasticSettings) -> str | None:
    """Why the decode side is under pressure, or None."""
    serving = obs.routable(*DECODE_CAPABLE)
    if obs.decode_waiting:
        return f"{obs.decode_waiting} requests wait for a decode slot"
    kv = _kv_use(serving, serving)
    if kv is not None and kv >= KV_HIGH:
        return f"decode KV {kv:.0%} used (>= {KV_HIGH:.0%})"
    step = _slowest_step(serving)
    if step >= STEP_HIGH * s.tpot_target_s:
        return (f"decode step {step * 1e3:.0f} ms (>= {STEP_HIGH:g} x the "
                f"{s.tpot_target_s * 1e3:.0f} ms TPOT target)")
    return None


def prefill_idle(obs: Observation, s: ElasticSettings) -> bool:
    """Prefill workers with a calm wait while every decode-capable worker is busy."""
    wait = prefill_wait_s(obs)
    serving = obs.routable(*DECODE_CAPABLE)
    return bool(obs.routable("prefill")) and bool(serving) and wait is not None and \
        wait <= PREFILL_CALM * s.ttft_target_s and all(w.inflight >= BUSY_STREAMS
                                                       for w in serving)


def tally(memory: Memory, obs: Observation, s: ElasticSettings) -> Memory:
    """The memory after one more observation."""
    wait = prefill_wait_s(obs)
    prefill = wait is not None and wait > PREFILL_HIGH * s.ttft_target_s
    decode = not prefill and decode_pressure(obs, s) is not None
    idle = not decode and prefill_idle(obs, s)
    return dataclasses.replace(memory,
                               prefill_ticks=memory.prefill_ticks + 1 if prefill else 0,
                               decode_ticks=memory.decode_ticks + 1 if decode else 0,
                               idle_ticks=memory.idle_ticks + 1 if idle else 0)


def decide(obs: Observation, memory: Memory, s: ElasticSettings) -> FlipPlan | None:
    """The flip to make now (see the module docstring), or None."""
    if memory.last_flip_at is not None and obs.now - memory.last_flip_at < s.cooldown_s:
        return None
    if any(w.phase is not None for w in obs.workers):
        return None
    if memory.prefill_ticks >= s.sustain_ticks:
        return _to_prefill(obs, memory, s)
    if memory.decode_ticks >= s.sustain_ticks:
        return _to_decode(obs, memory, s)
    if memory.idle_ticks >= s.sustain_ticks:
        return _to_decode(obs, memory, s, idle=True)
    return None


def _to_prefill(obs: Observation, memory: Memory, s: ElasticSettings) -> FlipPlan | None:
    decode = obs.routable("decode")
    if not decode or obs.decode_waiting:
        return None
    worker = min(decode, key=lambda w: (w.inflight, w.kv_used, w.key))
    serving = obs.routable(*DECODE_CAPABLE)
    rest = [w for w in serving if w.key != worker.key]
    if not rest:
        return None
    kv = _kv_use(serving, rest)
    step = _slowest_step(serving) * len(serving) / len(rest)
    if (kv is not None and kv > KV_CALM) or step > STEP_CALM * s.tpot_target_s:
        return None
    wait = prefill_wait_s(obs) or 0.0
    return FlipPlan(worker.key, "prefill",
                    f"prefill wait ~{wait * 1e3:.0f} ms over {PREFILL_HIGH:g} x the "
                    f"{s.ttft_target_s * 1e3:.0f} ms TTFT target for {memory.prefill_ticks} "
                    f"ticks; the other decode workers keep headroom (step ~{step * 1e3:.0f} ms, "
                    f"KV {kv or 0.0:.0%} projected)")


def _to_decode(obs: Observation, memory: Memory, s: ElasticSettings, idle: bool = False
               ) -> FlipPlan | None:
    prefill = obs.routable("prefill")
    if not prefill:
        return None
    worker = min(prefill, key=lambda w: (w.backlog_tokens, w.inflight, w.key))
    if len(prefill) == 1 and obs.prefill_demand:
        return None
    wait = prefill_wait_s(obs, without=worker.key)
    if wait is None or wait > PREFILL_CALM * s.ttft_target_s:
        return None
    if idle:
        why, ticks = (f"the prefill side idle while every decode-capable worker streams "
                      f">= {BUSY_STREAMS} requests"), memory.idle_ticks
    else:
        why, ticks = decode_pressure(obs, s) or "decode pressure", memory.decode_ticks
    return FlipPlan(worker.key, "decode",
                    f"{why} for {ticks} ticks; the prefill side keeps headroom "
                    f"(wait ~{wait * 1e3:.0f} ms projected without it)")


def _stage(obs: Observation, without: str | None) -> list[WorkerView]:
    prefill = [w for w in obs.routable("prefill") if w.key != without]
    return prefill or [w for w in obs.routable(*DECODE_CAPABLE) if w.key != without]


def _kv_use(used_by: Iterable[WorkerView], held_by: Iterable[WorkerView]) -> float | None:
    """KV blocks used by `used_by` over the blocks of `held_by`; None when `held_by` has none
    reported."""
    total = sum(w.kv_total for w in held_by)
    return sum(w.kv_used for w in used_by) / total if total > 0 else None


def _slowest_step(workers: Iterable[WorkerView]) -> float:
    """The slowest measured decode step; 0 when none was measured (no streams yet)."""
    return max((w.decode_step_s or 0.0 for w in workers), default=0.0)
