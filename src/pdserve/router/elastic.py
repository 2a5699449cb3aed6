"""Elastic pools: whether one worker should change role now, from one observation of the pools
and the controller's memory. Pure: no clock, no I/O (`elastic_controller.py` observes and
measures, keeps the memory and flips through `RoleFlips`, the admin endpoint's path).

Quantities, per observation (`Observation`, built each tick):

    S        the prefill stage: the routable prefill workers; with none, the routable
             decode-capable (decode, collocated) workers, which then prefill every prompt
    Q_w      prompt tokens sent to w whose prefill has not ended (the dispatcher's backlog)
    N_q      prompt tokens of the split requests waiting for a prefill slot
    R_w      w's prefill rate, tokens/s, from its signed /health `rates`: a prefill worker's
             measured rate; for a decode-capable worker R_d, the rate a prompt of the
             window's mean length gets there beside the legs it has open (from its marginal
             rate R_m, as the split decision counts it; `elastic_controller.stage_rate`)
    W(S)     = (sum_{w in S} Q_w + N_q) / sum_{w in S} R_w
             the wait, at this instant, of a new prompt before its prefill starts (0 with no
             tokens; unknown with tokens and no measured rate; unmeasured workers add no rate)
    T        the arrival window: a recent stretch of time, at least the sustain window and
             holding at least 8 prompts when the last ~60 s had them (`elastic_window.py`)
    A_w, n_w the uncached prompt tokens, and the prompts, the router sent w to prefill in T
    lam(X)   = sum_{w in X} A_w / T, the prompt tokens per second arriving at the workers X
    m(X)     = sum_{w in X} A_w / sum_{w in X} n_w, their mean prompt
    rho(S|X) = lam(X) / sum_{w in S} R_w, the busy fraction of stage S prefilling what arrives
             at X (here a worker not measured yet counts at the mean of the measured rates:
             the same model on the same kind of machine; unknown when none is measured)
    Wq(S|X)  = rho / (1 - rho) x m(X) / Rbar(S), Rbar(S) the mean rate of S's workers: the mean
             wait of a prompt before its prefill starts, in the steady state (infinite for
             rho >= 1)
    D        the routable decode-capable workers; D_q requests waiting for a decode slot
    K(D)     = sum_{w in D} kv_used / sum_{w in D} kv_total, the KV use of the decode side
    s(D)     the slowest measured decode-only step in D (the floor of its streams' ITL)

Why rates (queueing). A stage that receives lam tokens/s and prefills mu = sum R_w tokens/s has
utilization rho = lam / mu. With rho >= 1 its queue grows without bound, whatever it holds at
one instant; below 1 a prompt waits Wq = rho / (1 - rho) x its service time on average (M/M/1:
Poisson arrivals; prompts of like lengths wait less, M/D/1 halves it; several workers sharing
the arrivals wait less than one worker at the same rho, so one mean worker's bound is safe for
them). The instant's backlog W(S) says nothing about rho: under a steady stream of long prompts
that one prefill worker cannot keep up with (the router then prefills part of them on the
decode workers), the prefill worker's backlog is empty between two arrivals, and an idle
trigger judged from it took that lull for idleness, flipped the worker away and brought the
overload onto the decode side, which flipped a worker back (three flips in 90 s). Judged from
lam over T, a lull between two prompts is a small part of the window.

Prefill pressure: W(S) > PREFILL_HIGH x TTFT, unless the rates over the window put S in the
calm band a flip away from it must leave (rho(S|S) <= RHO_CALM and Wq(S|S) <= PREFILL_CALM x
TTFT: one long prompt's own prefill, or a few prompts of a quiet stream, is no trend; unknown
rates do not hold pressure back). Decode pressure, when there is no prefill
pressure (a decode queue may only be requests held up by the prefill side): D_q > 0, or
K(D) >= KV_HIGH, or s(D) >= STEP_HIGH x TPOT. An idle prefill side: prefill workers busy at
most half the time over the window, rho(S|S) <= RHO_IDLE, with nothing waiting now, W(S) <=
PREFILL_CALM x TTFT, while every routable decode-capable worker has at least BUSY_STREAMS legs
in flight (the targets are met, but a prefill worker's core waits for prompts that the decode
workers' paced local prefills could take, while every stream shares the decode cores). The
memory counts the ticks each was seen in a row (`tally`).

Rules (`decide`; `consider` also says why a sustained pressure flips no worker), at most one
flip per tick:
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
  the prefill side keeps headroom without it (S' = S minus that worker, or, when no prefill
  worker is left, D and the worker itself, which then prefills in paced chunks at the rate D's
  workers measure), both now and in the steady state of the arrivals measured:
      W'   = (sum_{S u S'} Q_w + N_q) / sum_{S'} R_w         <= PREFILL_CALM x TTFT
      rho' = rho(S' | S u S')                                <= RHO_CALM
      Wq'  = Wq(S' | S u S')                                 <= PREFILL_CALM x TTFT
  (S' takes every prompt that now arrives at S and at S'), and, if it is the last prefill
  worker, no split request holds or waits for a prefill slot. Under a steady overload of the
  prefill side rho' > 1 > RHO_CALM, so no prefill worker is ever flipped away, however empty
  its queue is between two prompts.

Hysteresis: each flip's projection must land inside the calm band of the pressure it could
create (K' <= KV_CALM < KV_HIGH, s' <= STEP_CALM x TPOT < STEP_HIGH x TPOT, W' <= PREFILL_CALM
x TTFT < PREFILL_HIGH x TTFT, and rho' and Wq' inside the very band that holds prefill
pressure back), so under a steady load a flip never produces the pressure that would flip the
worker back; noise is absorbed by `sustain_ticks` and the cool-down. (Time-averaged, W(S) is
Wq: a Poisson arrival sees the time average of the work queued, PASTA; so Wq' <= PREFILL_CALM
x TTFT keeps W(S') at half the trigger on average.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.worker_pool import LENT

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
# Busy at most half the time over the window: the prefill stage is not what limits the cluster.
RHO_IDLE = 0.5
# The busiest a stage may be left by a flip that takes a worker from it: the window's rate is
# off by ~35% (8 prompts), and 0.7 x 1.35 still drains; from 0.7 on, Wq grows steeply
# (rho / (1 - rho): 2.3 service times at 0.7, 9 at 0.9).
RHO_CALM = 0.7


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
    sent_prompts: int = 0  # n_w: prompts sent to it to prefill within the window
    sent_tokens: int = 0  # A_w: their uncached tokens
    host: str | None = None  # the machine its cores are on (/health `host`)
    cpus: tuple[int, ...] = ()  # the cores it reports
    borrowing: bool = False  # it computes on cores lent to it (`core_lending.py`)


@dataclass(frozen=True)
class Observation:
    now: float  # monotonic seconds
    workers: tuple[WorkerView, ...]
    prefill_waiting_tokens: int = 0  # N_q
    prefill_demand: int = 0  # split requests holding or waiting for a prefill slot
    decode_waiting: int = 0  # D_q
    window_s: float = 0.0  # T, the arrival window (0: none yet, so no rate is known)

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

    def ticks(self, pressure: str) -> int:
        """The consecutive ticks of `pressure` ("prefill", "decode" or "idle")."""
        return {"prefill": self.prefill_ticks, "decode": self.decode_ticks,
                "idle": self.idle_ticks}[pressure]


@dataclass(frozen=True)
class FlipPlan:
    worker: str
    to: str
    reason: str


@dataclass(frozen=True)
class Hold:
    """A pressure sustained long enough to flip, and why no worker flips for it."""

    pressure: str  # "prefill", "decode" or "idle": the count that reached `sustain_ticks`
    reason: str


@dataclass(frozen=True)
class StageLoad:
    """A prefill stage under the prompts that arrived over the window."""

    tokens_per_s: float  # lam(X)
    rho: float  # rho(S|X)
    wait_s: float  # Wq(S|X); infinite for rho >= 1


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


def stage_load(obs: Observation, stage: list[WorkerView], fed: Iterable[WorkerView]
               ) -> StageLoad | None:
    """`stage` prefilling every prompt the window sent to the workers `fed`; None with no
    window yet, or with prompts and no rate measured anywhere."""
    if obs.window_s <= 0:
        return None
    fed = list(fed)
    tokens, prompts = sum(w.sent_tokens for w in fed), sum(w.sent_prompts for w in fed)
    if tokens <= 0:
        return StageLoad(0.0, 0.0, 0.0)
    measured = [w.prefill_tokens_per_s for w in obs.workers if w.prefill_tokens_per_s]
    if not stage or not measured:
        return None
    prior = sum(measured) / len(measured)
    capacity = sum(w.prefill_tokens_per_s or prior for w in stage)
    arrivals = tokens / obs.window_s
    rho = arrivals / capacity
    service = tokens / max(prompts, 1) / (capacity / len(stage))
    return StageLoad(arrivals, rho, rho / (1 - rho) * service if rho < 1 else math.inf)


def prefill_pressure(obs: Observation, s: ElasticSettings) -> bool:
    """A new prompt waits longer than PREFILL_HIGH x TTFT now, and the rates over the window
    do not put the stage in the calm band (the backlog of one long prompt, or of a few in a
    quiet stream, is no trend)."""
    wait = prefill_wait_s(obs)
    if wait is None or wait <= PREFILL_HIGH * s.ttft_target_s:
        return False
    stage = _stage(obs, None)
    load = stage_load(obs, stage, stage)
    return load is None or not _calm(load, s)


def room_pressure(obs: Observation) -> str | None:
    """Why the decode side is short of room (requests wait for a slot, or its KV is at
    KV_HIGH), or None: what another decode engine's slots and pool relieve."""
    serving = obs.routable(*DECODE_CAPABLE)
    if obs.decode_waiting:
        return f"{obs.decode_waiting} requests wait for a decode slot"
    kv = _kv_use(serving, serving)
    if kv is not None and kv >= KV_HIGH:
        return f"decode KV {kv:.0%} used (>= {KV_HIGH:.0%})"
    return None


def decode_pressure(obs: Observation, s: ElasticSettings) -> str | None:
    """Why the decode side is under pressure, or None."""
    room = room_pressure(obs)
    if room is not None:
        return room
    step = _slowest_step(obs.routable(*DECODE_CAPABLE))
    if step >= STEP_HIGH * s.tpot_target_s:
        return (f"decode step {step * 1e3:.0f} ms (>= {STEP_HIGH:g} x the "
                f"{s.tpot_target_s * 1e3:.0f} ms TPOT target)")
    return None


def prefill_idle(obs: Observation, s: ElasticSettings) -> bool:
    """Prefill workers busy at most RHO_IDLE of the window, nothing waiting for them now,
    while every decode-capable worker streams."""
    prefill, serving = obs.routable("prefill"), obs.routable(*DECODE_CAPABLE)
    if not prefill or not serving or any(w.inflight < BUSY_STREAMS for w in serving):
        return False
    wait, load = prefill_wait_s(obs), stage_load(obs, prefill, prefill)
    return wait is not None and wait <= PREFILL_CALM * s.ttft_target_s and \
        load is not None and load.rho <= RHO_IDLE


def tally(memory: Memory, obs: Observation, s: ElasticSettings) -> Memory:
    """The memory after one more observation."""
    prefill = prefill_pressure(obs, s)
    decode = not prefill and decode_pressure(obs, s) is not None
    idle = not decode and prefill_idle(obs, s)
    return dataclasses.replace(memory,
                               prefill_ticks=memory.prefill_ticks + 1 if prefill else 0,
                               decode_ticks=memory.decode_ticks + 1 if decode else 0,
                               idle_ticks=memory.idle_ticks + 1 if idle else 0)


def decide(obs: Observation, memory: Memory, s: ElasticSettings) -> FlipPlan | None:
    """The flip to make now (see the module docstring), or None."""
    plan = consider(obs, memory, s)
    return plan if isinstance(plan, FlipPlan) else None


def consider(obs: Observation, memory: Memory, s: ElasticSettings) -> FlipPlan | Hold | None:
    """`decide`, and where a pressure was sustained long enough and the rules keep every
    worker (the other side's headroom, the last worker of a role), a `Hold` saying why; None
    with no pressure sustained, within the cool-down or while a worker flips or drains."""
    if not settled(obs, memory, s):
        return None
    if memory.prefill_ticks >= s.sustain_ticks:
        return _to_prefill(obs, memory, s)
    if memory.decode_ticks >= s.sustain_ticks:
        return _to_decode(obs, memory, s)
    if memory.idle_ticks >= s.sustain_ticks:
        return _to_decode(obs, memory, s, idle=True)
    return None


def settled(obs: Observation, memory: Memory, s: ElasticSettings) -> bool:
    """Past the cool-down of the last change, with no worker flipping or draining (a worker
    whose cores are lent is settled: it stays so until reclaimed)."""
    if memory.last_flip_at is not None and obs.now - memory.last_flip_at < s.cooldown_s:
        return False
    return all(w.phase in (None, LENT) for w in obs.workers)


def _to_prefill(obs: Observation, memory: Memory, s: ElasticSettings) -> FlipPlan | Hold:
    routable = obs.routable("decode")
    decode = [w for w in routable if not w.borrowing]
    if not decode:
        return Hold("prefill", "every routable decode worker computes on lent cores: each "
                               "prefills its prompts there" if routable else
                               "no routable decode worker to take")
    if obs.decode_waiting:
        return Hold("prefill", f"{obs.decode_waiting} requests wait for a decode slot")
    worker = min(decode, key=lambda w: (w.inflight, w.kv_used, w.key))
    serving = obs.routable(*DECODE_CAPABLE)
    rest = [w for w in serving if w.key != worker.key]
    if not rest:
        return Hold("prefill", f"{worker.key} is the last decode-capable worker")
    kv = _kv_use(serving, rest)
    step = _slowest_step(serving) * len(serving) / len(rest)
    if (kv is not None and kv > KV_CALM) or step > STEP_CALM * s.tpot_target_s:
        return Hold("prefill", f"without {worker.key} the decode side would be left at KV "
                               f"{kv or 0.0:.0%} (calm: <= {KV_CALM:.0%}) and a step of "
                               f"~{step * 1e3:.0f} ms (calm: <= {STEP_CALM:g} x the "
                               f"{s.tpot_target_s * 1e3:.0f} ms TPOT target)")
    wait = prefill_wait_s(obs) or 0.0
    return FlipPlan(worker.key, "prefill",
                    f"prefill wait ~{wait * 1e3:.0f} ms over {PREFILL_HIGH:g} x the "
                    f"{s.ttft_target_s * 1e3:.0f} ms TTFT target for {memory.prefill_ticks} "
                    f"ticks; the other decode workers keep headroom (step ~{step * 1e3:.0f} ms, "
                    f"KV {kv or 0.0:.0%} projected)")


def _to_decode(obs: Observation, memory: Memory, s: ElasticSettings, idle: bool = False
               ) -> FlipPlan | Hold:
    pressure = "idle" if idle else "decode"
    prefill = obs.routable("prefill")
    if not prefill:
        return Hold(pressure, "no routable prefill worker to take")
    worker = min(prefill, key=lambda w: (w.backlog_tokens, w.inflight, w.key))
    if len(prefill) == 1 and obs.prefill_demand:
        return Hold(pressure, f"{worker.key} is the last prefill worker and "
                              f"{obs.prefill_demand} split requests hold or wait for it")
    calm_s = PREFILL_CALM * s.ttft_target_s
    wait = prefill_wait_s(obs, without=worker.key)
    if wait is None:
        return Hold(pressure, f"without {worker.key} no worker left to prefill has a "
                              "measured prefill rate")
    if wait > calm_s:
        return Hold(pressure, f"without {worker.key} a prompt would wait ~{wait * 1e3:.0f} "
                              f"ms to prefill (calm: <= {calm_s * 1e3:.0f} ms)")
    rest = _after_flip(obs, worker)
    load = stage_load(obs, rest, {w.key: w for w in [*_stage(obs, None), *rest]}.values())
    if load is None:
        return Hold(pressure, "no prefill rate or arrival window measured yet")
    if not _calm(load, s):
        return Hold(pressure, f"without {worker.key}, at the {load.tokens_per_s:.0f} prompt "
                              f"tokens/s of the last {obs.window_s:.0f} s, the prefill side "
                              f"would be busy {load.rho:.0%} of the time, a prompt's wait "
                              f"{_wait(load.wait_s)} (calm: <= {RHO_CALM:.0%}, "
                              f"<= {calm_s * 1e3:.0f} ms)")
    if idle:
        why, ticks = (f"the prefill side idle while every decode-capable worker streams "
                      f">= {BUSY_STREAMS} requests"), memory.idle_ticks
    else:
        why, ticks = decode_pressure(obs, s) or "decode pressure", memory.decode_ticks
    return FlipPlan(worker.key, "decode",
                    f"{why} for {ticks} ticks; the prefill side keeps headroom "
                    f"(wait ~{wait * 1e3:.0f} ms projected without it; at the "
                    f"{load.tokens_per_s:.0f} prompt tokens/s of the last {obs.window_s:.0f} s "
                    f"busy {load.rho:.0%} of the time, a prompt waiting "
                    f"~{load.wait_s * 1e3:.0f} ms)")


def _wait(seconds: float) -> str:
    return "growing without bound" if math.isinf(seconds) else f"~{seconds * 1e3:.0f} ms"


def _calm(load: StageLoad, s: ElasticSettings) -> bool:
    """The band a flip away from the prefill stage must leave it in."""
    return load.rho <= RHO_CALM and load.wait_s <= PREFILL_CALM * s.ttft_target_s


def _after_flip(obs: Observation, worker: WorkerView) -> list[WorkerView]:
    """The prefill stage once `worker` is a decode worker: the other prefill workers, or, when
    it was the last, every decode-capable worker, itself included (it prefills there too, in
    paced chunks beside its streams: at the rate the decode-capable workers measure, not at its
    own whole-prompt rate)."""
    rest = _stage(obs, worker.key)
    if obs.routable("prefill") != [worker]:
        return rest
    paced = [w.prefill_tokens_per_s for w in rest if w.prefill_tokens_per_s]
    rate = sum(paced) / len(paced) if paced else None
    return [*rest, dataclasses.replace(worker, prefill_tokens_per_s=rate)]


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
