"""Elastic pools, second move: lending a prefill worker's cores to a decode worker of the same
machine (`core_lending.py`), and taking them back. Pure, like `elastic.py`, whose quantities
(W, rho, Wq, the calm band) it uses; `elastic_controller.py` acts on the plan.

Why a loan where no flip helps. With one prefill worker P and one decode worker D, prefill
pressure (`elastic.prefill_pressure`) cannot take D (the last decode-capable worker: `Hold`).
Often it is not the queue but the prompt itself: a prompt of m tokens on P's cores takes
m / R_P, and on a machine split in halves that alone may exceed the TTFT target (1,500 tokens
on one core of two: ~2.1 s against 2 s). Lent, P's cores join D's, and with no routable
prefill worker left the split decision prefills every prompt on D in chunks paced to the TPOT
target: each prompt at the speed of both halves, the streams' steps within the target. The
capacity is about the same (the same cores); the prompt's own time halves, and the streams pay
at most the TPOT target while a prompt prefills, which the target allows.

Rules, evaluated when the pools are settled (`elastic.settled`: past the cool-down, nobody
flipping or draining), at most one change per tick, before the flip rules:
- Reclaim a lent worker L after `sustain_ticks` in a row in which L, back as the only new
  member of the prefill stage S' = (routable prefill workers) + L, would leave it deep in the
  calm band for every prompt arriving anywhere: rho(S' | all) <= RHO_IDLE and
  Wq(S' | all) <= RECLAIM_WAIT x TTFT (L's rate is its whole-prompt rate measured before it
  lent its cores: a lent worker computes nothing and its report keeps it).
- Lend when the flip rules hold a sustained prefill pressure (`Hold("prefill", ...)`) and:
  the routable prefill worker P is the last one (a loan of one of several would slow the
  others' share of the prompts, which they keep prefilling whole on fewer cores); a routable
  decode-capable worker D reports the same host and cores of its own; D's measured decode step
  s_D <= STEP_CALM x TPOT (room beside its streams for paced chunks). Of several such D, the
  one with the fewest cores, then legs. P is drained first (`core_lending.py`).

Merging instead of a second decode engine. Where the flip rules would take the last prefill
worker P to decode (decode pressure from the step time, or an idle prefill side beside busy
decoders), the prefill stage after the flip is the decode-capable workers prefilling in paced
chunks either way; the flip adds a second decode engine on P's cores, the loan adds P's cores
to a decode worker D of the same machine: collocated serving with paced chunks. Decoding is
bound by reading the weights (SmolLM2's 270 MB in bf16 each step): one engine on both halves
reads them once a step for all its streams, two engines once each, which costs the pair its
share where one core alone reads memory about as fast as two (the pair at 0.79-0.89x
collocated's tokens on such a machine), and little where each core has its own bandwidth (the
pair at ~1.07x on another); either way one engine prefills each prompt on both halves where the
pair uses one. So the loan replaces the flip, with the flip's own
projections (`elastic._to_decode`) as its condition, when P and a routable decode-capable D
report the same host and cores, unless the pressure is for room: requests waiting for a
decode slot, or KV use at KV_HIGH, which a second engine's pool relieves and a loan does not.
Of several such D, the one with the most legs, then the fewest cores. Measured on 2 vCPUs
(docs/benchmarks.md): chat at 16 clients, the flipped pair 0.89x a collocated worker's output
tokens/s, the merged one 0.97x.

At rest the pair is merged. A same-host pair that no prompt reached within the arrival window
(a minute, or since the controller started) has its lender's cores lent to a neighbour on
other cores at once (no sustain ticks: the window is the evidence), so the first prompts of
the next burst prefill on both halves with nothing to wait for; split at rest, the first
prompts of a long-prompt burst each took the lender's one half (~2 s for 1,500 tokens on one
core of two) and then waited for the loan's drain, which cost the first seconds of every
ingestion. Only a prefill worker whose cores are its own (no other worker on its machine
computes on any of them) lends at rest: where it shares them, its cores are no spare half.

Hysteresis: a lend needs prefill pressure, that is W > PREFILL_HIGH x TTFT with the stage
outside the calm band (rho > RHO_CALM or Wq > PREFILL_CALM x TTFT); a reclaim needs rho <=
RHO_IDLE < RHO_CALM and Wq <= RECLAIM_WAIT x TTFT < PREFILL_CALM x TTFT, judged for L alone,
the stage the lend left: between the two bands the loan stands. A reclaim also needs a rate:
the window holding MIN_PROMPTS prompts (their rate within ~35%), where a rest loan needs none,
so between a prompt and MIN_PROMPTS a window the loan stands too (a few prompts a minute gain
more from both halves' speed than from a split). L's rate is the one it measured; one that lent
before it prefilled anything is priced at its borrower's rate scaled by their cores (prefill is
compute-bound: the rate goes with the cores), not at the mean of the measured rates, which is
the borrower's on both sets. A reclaim also needs the
decode side to keep the cores' worth of headroom, or the merge rule would lend them again: every
borrower on the lender's machine with fewer than BUSY_STREAMS legs (the idle rule's trigger)
and a decode step that, priced on its own cores (s x its cores / its own), stays within
STEP_CALM x TPOT. Noise within the arrival
window (~35% at 8 prompts) is absorbed by the sustain ticks and the cool-down, as for flips.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.router.elastic import (
    BUSY_STREAMS,
    DECODE_CAPABLE,
    PREFILL_CALM,
    RHO_IDLE,
    STEP_CALM,
    FlipPlan,
    Hold,
    Memory,
    Observation,
    WorkerView,
    consider,
    room_pressure,
    settled,
    stage_load,
)
from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.elastic_window import MIN_PROMPTS
from pdserve.router.worker_pool import LENT

# Half the calm band's wait: a reclaim must leave the stage well inside the band whose edge
# lets prefill pressure (and so a new loan) count again.
RECLAIM_WAIT = PREFILL_CALM / 2


@dataclass(frozen=True)
class LendPlan:
    worker: str  # the prefill worker whose cores are lent
    to: str  # the decode-capable worker that gets them
    reason: str


@dataclass(frozen=True)
class ReclaimPlan:
    worker: str  # the lent worker, which serves as a prefill worker again
    reason: str


Plan = FlipPlan | LendPlan | ReclaimPlan


@dataclass(frozen=True)
class LoanMemory:
    """What the controller remembers between ticks about its loans."""

    reclaim_ticks: dict[str, int] = dataclasses.field(default_factory=dict)  # lender -> ticks


def tally_loans(memory: LoanMemory, obs: Observation, s: ElasticSettings) -> LoanMemory:
    """Each lent worker's consecutive ticks in which a reclaim would leave the stage calm."""
    return LoanMemory({w.key: memory.reclaim_ticks.get(w.key, 0) + 1
                       for w in _lent(obs) if _reclaim_load(obs, w, s) is not None})


def choose(obs: Observation, memory: Memory, loans: LoanMemory, s: ElasticSettings
           ) -> Plan | Hold | None:
    """The change to make now (a reclaim first, then a pair at rest merged, then the flip
    rules, with a loan where they hold a prefill pressure), a Hold saying why none, or None."""
    if not settled(obs, memory, s):
        return None
    for lender in _lent(obs):
        ticks = loans.reclaim_ticks.get(lender.key, 0)
        load = _reclaim_load(obs, lender, s)
        if ticks >= s.sustain_ticks and load is not None:
            return ReclaimPlan(lender.key, load)
    rest = rest_plan(obs)
    if rest is not None:
        return rest
    plan = consider(obs, memory, s)
    if isinstance(plan, Hold) and plan.pressure == "prefill":
        return lend_plan(obs, memory, s, plan)
    if isinstance(plan, FlipPlan) and plan.to == "decode":
        return merge_plan(obs, plan) or plan
    return plan


def lend_plan(obs: Observation, memory: Memory, s: ElasticSettings, hold: Hold
              ) -> LendPlan | Hold:
    """A loan for the prefill pressure `hold` describes, or the hold with why none."""
    prefill = obs.routable("prefill")
    if len(prefill) != 1:
        return hold if not prefill else Hold("prefill", f"{hold.reason}; no loan: "
                                             f"{len(prefill)} prefill workers share the prompts")
    lender = prefill[0]
    if not lender.host or not lender.cpus:
        return Hold("prefill", f"{hold.reason}; no loan: {lender.key} reports no host and "
                               "cores")
    borrowers = [w for w in _neighbours(obs, lender)
                 if (w.decode_step_s or 0.0) <= STEP_CALM * s.tpot_target_s]
    if not borrowers:
        return Hold("prefill", f"{hold.reason}; no loan: no decode worker on {lender.key}'s "
                               "machine with room for paced prefills beside its streams")
    to = min(borrowers, key=lambda w: (len(w.cpus), w.inflight, w.key))
    return LendPlan(lender.key, to.key,
                    f"prefill pressure for {memory.prefill_ticks} ticks that no flip relieves "
                    f"({hold.reason}): {to.key} prefills every prompt on its cores and "
                    f"{lender.key}'s, in chunks paced to the TPOT target")


def merge_plan(obs: Observation, flip: FlipPlan) -> LendPlan | None:
    """The loan that replaces `flip`, the last prefill worker to decode (the merge rule
    above), or None: the flip stands."""
    prefill = obs.routable("prefill")
    if [w.key for w in prefill] != [flip.worker] or room_pressure(obs) is not None:
        return None
    lender = prefill[0]
    borrowers = _neighbours(obs, lender) if lender.host and lender.cpus else []
    if not borrowers:
        return None
    to = min(borrowers, key=lambda w: (-w.inflight, len(w.cpus), w.key))
    return LendPlan(lender.key, to.key,
                    f"{flip.reason}; {to.key} computes on its cores and {lender.key}'s instead "
                    f"of a second decode engine there: one engine reads the weights once a "
                    f"step for all its streams and prefills on both")


def rest_plan(obs: Observation) -> LendPlan | None:
    """The loan that merges a same-host pair at rest (the rest rule above), or None."""
    prefill = obs.routable("prefill")
    if len(prefill) != 1 or obs.prefill_demand or _prompts(obs):
        return None
    lender = prefill[0]
    if lender.inflight or lender.backlog_tokens or not _own_cores(obs, lender):
        return None
    borrowers = _neighbours(obs, lender)
    if not borrowers:
        return None
    to = min(borrowers, key=lambda w: (-w.inflight, len(w.cpus), w.key))
    quiet = f"in the last {obs.window_s:.0f} s" if obs.window_s >= 1 else "yet"
    return LendPlan(lender.key, to.key,
                    f"no prompt arrived {quiet}: {to.key} computes on its cores and "
                    f"{lender.key}'s, so that the next prompts prefill on both")


def _own_cores(obs: Observation, lender: WorkerView) -> bool:
    """`lender` reports its host and cores, and no other worker there computes on any."""
    if not lender.host or not lender.cpus:
        return False
    return not any(set(w.cpus) & set(lender.cpus) for w in obs.workers
                   if w.key != lender.key and w.host == lender.host)


def _prompts(obs: Observation) -> int:
    """The prompts the router sent to prefill within the arrival window."""
    return sum(w.sent_prompts for w in obs.workers)


def _neighbours(obs: Observation, lender: WorkerView) -> list[WorkerView]:
    """The routable decode-capable workers on `lender`'s machine that report their cores: those
    a loan of its cores may go to."""
    return [w for w in obs.routable(*DECODE_CAPABLE) if w.host == lender.host and w.cpus]


def _lent(obs: Observation) -> list[WorkerView]:
    return [w for w in obs.workers if w.phase == LENT]


def _reclaim_load(obs: Observation, lender: WorkerView, s: ElasticSettings) -> str | None:
    """Why `lender` may serve as a prefill worker again (the reclaim band above), or None."""
    if _prompts(obs) < MIN_PROMPTS:
        return None
    stage = [*obs.routable("prefill"), _priced(obs, lender)]
    load = stage_load(obs, stage, obs.workers)
    if load is None or load.rho > RHO_IDLE or load.wait_s > RECLAIM_WAIT * s.ttft_target_s:
        return None
    if _borrowers_need_cores(obs, lender, s):
        return None
    return (f"with {lender.key} back as a prefill worker, at the {load.tokens_per_s:.0f} prompt "
            f"tokens/s of the last {obs.window_s:.0f} s the prefill side would be busy "
            f"{load.rho:.0%} of the time (<= {RHO_IDLE:.0%}), a prompt waiting "
            f"~{load.wait_s * 1e3:.0f} ms (<= {RECLAIM_WAIT * s.ttft_target_s * 1e3:.0f} ms)")


def _priced(obs: Observation, lender: WorkerView) -> WorkerView:
    """`lender` with its measured rate, else its borrower's scaled by their cores (the rate
    goes with the cores: prefill is compute-bound); as it is when neither is known."""
    if lender.prefill_tokens_per_s:
        return lender
    for w in obs.workers:
        if w.borrowing and w.host == lender.host and w.prefill_tokens_per_s and w.cpus:
            rate = w.prefill_tokens_per_s * len(lender.cpus) / len(w.cpus)
            return dataclasses.replace(lender, prefill_tokens_per_s=rate)
    return lender


def _borrowers_need_cores(obs: Observation, lender: WorkerView, s: ElasticSettings) -> bool:
    """A borrower on `lender`'s machine streams BUSY_STREAMS legs or more, or would step slower
    than STEP_CALM x TPOT on its own cores (its step scaled by its cores over its own)."""
    for w in obs.workers:
        if not w.borrowing or w.host != lender.host:
            continue
        own = len(set(w.cpus) - set(lender.cpus)) or len(w.cpus)
        step = (w.decode_step_s or 0.0) * len(w.cpus) / max(own, 1)
        if w.inflight >= BUSY_STREAMS or step > STEP_CALM * s.tpot_target_s:
            return True
    return False
