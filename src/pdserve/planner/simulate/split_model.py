"""Where a split layout prefills each prompt, and how fast a decode worker prefills beside its
streams: the router's conditional disaggregation (router/split_decision.py, router/dispatch.py,
router/path_choice.py) and a decode worker's paced prefill chunk (workers/prefill_budget.py),
restated in the simulator's terms (the planner imports no serving code).

Rules (`SplitRule`, after the router's `--local-prefill-threshold`):
- remote (threshold 0): every prompt goes to a prefill worker and its KV to a decode worker
  chosen when its prefill ends (the simulator's original model).
- local (threshold 2**31 - 1): every prompt is prefilled on its decode worker.
- measured (no threshold: `pdserve up`'s default): per arriving request, with d the decode
  worker with the fewest open requests (the router's least-loaded policy over its legs in
  flight: local prompts not yet prefilled, split ones from arrival on, running streams; ties to
  the lowest index), N its prompt tokens and U_w those the router counts uncached on worker w
  (what it routed there: prefix_cache.RoutedPrefixes):

      t_remote = min over prefill workers p of (Q_p + U_p) / R_p(U_p)  +  T_link(N)
      t_local  = (Q_d + U_d) / R_d
      local   <=>  t_local <= t_remote  (ties: the prefill worker of lowest index)

  Q_w: uncached prompt tokens sent to w whose prefill has not ended (as the router's
  `PrefillBacklog` counts them); R_p(U) = U / step(U alone), the rate a prefill step of this
  size runs at; T_link(N): the Cluster's transfer time of the whole prompt's KV (the decode
  side receives every prompt block, as the engine does); R_d: with streams decoding on d,
  C / step(C beside them), C the paced chunk below for a chunk at the prompt's middle (the
  mean context its chunks attend to: the rate a prompt progresses at there, as a worker's
  steps that also decoded report it, averaged over them), else R_p (no stream: no cap).
  The decision's TPOT-stall test never fires: `pdserve up` gives a split layout's decode
  workers `--slo-tpot-ms` = the router's target, so they pace and their stall needs no check.

Pacing (a decode worker's local prompts, FIFO, beside its streams):

      C = max(block, floor((tpot - s) x R))

s = step(decodes alone) at the current batch and context; R = C / (step(C beside them) - s),
the marginal rate of the worker's own paced steps (it measures R over them), so the steady C
is the largest with step(C beside the batch) <= tpot: found by bisection, since a step never
gets faster with more prompt tokens. At least one block (`BLOCK_TOKENS`) per step, so a prompt
always progresses; at most the prompt tokens ready; with no stream decoding, no cap.

Not modelled: the router's fallback before any rate is measured (router/path_choice.py: the
first prompts of a run, until the health check after its first prompt steps; it shares them
between the workers by queued tokens, as the rule above does at equal rates), the KV-usage
term of the least-loaded policy, and the router's measured inputs (the rates here are the
cost model's, for this prompt, at the decision):
- R_d: the router derives it from the decode worker's reported marginal prefill rate R_m
  (router/split_decision.py: R_m with no leg open, else C / (s + C / R_m) beside its streams),
  R_m measured over its last prompt steps; here the cost model's rate for this prompt beside
  the streams decoding now, which is what that rule estimates.
- T_link: the router's estimate from its recent hand-overs (the decode side's wait for its
  step included), else the prefill worker's report, else 0 once neither is in memory
  (router/link_estimates.py); here the Cluster's wire time.
- R_p: the prefill worker's reported rate over its last 64 prompt steps, against U / step(U
  alone) here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.planner.simulate.calibration import Chunk, StepCosts

DEFAULT_TPOT_TARGET_S = 0.1  # `pdserve up --slo-tpot-ms` default (100 ms)
BLOCK_TOKENS = 16  # the engine's KV block: a paced step's smallest prompt chunk
FIT_SLACK = 1e-9  # relative: a step equal to the target up to float rounding fits

ChunkPlan = Callable[[int], Sequence[Chunk]]  # n prompt tokens -> the chunks that compute them


class SplitRule(StrEnum):
    REMOTE = "remote"
    LOCAL = "local"
    MEASURED = "measured"


@dataclass(frozen=True)
class Route:
    """One measured-rule decision: the two estimates and the prefill worker of t_remote."""

    local: bool
    t_local_s: float
    t_remote_s: float
    prefill_index: int


def paced_tokens(costs: StepCosts, plan: ChunkPlan, most: int, decodes: int,
                 context_sum: int, tpot_target_s: float) -> int:
    """C for a step of `decodes` streams (summed context `context_sum`) whose prompt tokens
    `plan` lays out: the largest n in [min(BLOCK_TOKENS, most), most] whose step fits the
    target, else that lower bound. `most` >= 1."""
    def fits(n: int) -> bool:
        seconds = costs.step_seconds(plan(n), decodes, context_sum)
        return seconds <= tpot_target_s * (1 + FIT_SLACK)

    low = min(BLOCK_TOKENS, most)
    if fits(most):
        return most
    if not fits(low):
        return low
    fit, over = low, most  # invariant: fits(fit) and not fits(over)
    while over - fit > 1:
        mid = (fit + over) // 2
        fit, over = (mid, over) if fits(mid) else (fit, mid)
    return fit


def prefill_rate(costs: StepCosts, tokens: int) -> float:
    """R_p: tokens/s of a prefill step of one whole prompt of `tokens`."""
    return tokens / costs.step_seconds([Chunk(0, tokens, True)], 0, 0)


def local_rate(costs: StepCosts, tokens: int, decodes: int, context_sum: int,
               tpot_target_s: float) -> float:
    """R_d: tokens/s a prompt of `tokens` progresses at on a decode worker running `decodes`
    streams, taken at its middle (a chunk there attends to half the prompt: the mean over its
    chunks, which the worker's measured rate averages); with none, a whole-prompt step's rate."""
    if not decodes:
        return prefill_rate(costs, tokens)
    middle = tokens // 2

    def plan(n: int) -> list[Chunk]:
        return [Chunk(middle, n, False)]

    n = paced_tokens(costs, plan, tokens - middle, decodes, context_sum, tpot_target_s)
    return n / costs.step_seconds(plan(n), decodes, context_sum)


def route(uncached: int, decode_backlog: int, decode_rate: float,
          prefill_backlogs: Sequence[int], remote_uncached: Sequence[int],
          remote_rate: Callable[[int], float], link_s: float) -> Route:
    """The measured rule (module docstring): `uncached` tokens on the decode worker,
    `remote_uncached[i]` on prefill worker i behind `prefill_backlogs[i]` (non-empty), which
    computes U tokens at `remote_rate(U)` (one cost model for them all); `link_s`: T_link(N)."""
    each = [(q + u) / remote_rate(u) + link_s
            for q, u in zip(prefill_backlogs, remote_uncached, strict=True)]
    t_remote, best = min((t, i) for i, t in enumerate(each))
    t_local = (decode_backlog + uncached) / decode_rate
    return Route(t_local <= t_remote, t_local, t_remote, best)
