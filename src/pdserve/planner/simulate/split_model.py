"""Where a split layout prefills each prompt: the router's conditional disaggregation
(router/split_decision.py, router/path_choice.py) restated in the simulator's terms (the
planner imports no serving code), on the speeds the simulated workers report of themselves
(step_window.py), as the router decides on the speeds served workers report.

Rules (`SplitRule`, after the router's `--local-prefill-threshold`):
- remote (threshold 0): every prompt goes to a prefill worker and its KV to a decode worker
  chosen when its prefill ends (the simulator's original model).
- local (threshold 2**31 - 1): every prompt is prefilled on its decode worker.
- measured (no threshold: `pdserve up`'s default): per arriving request, with d the decode
  worker with the fewest open requests (the router's least-loaded policy over its legs in
  flight: local prompts not yet prefilled, split ones from arrival on, running streams; ties to
  the lowest index), N its prompt tokens and U_w those the router counts uncached on worker w
  (what it routed there: prefix_cache.RoutedPrefixes):

      t_remote = min over prefill workers p of (Q_p + U_p) / R_p  +  T_link(N)
      t_local  = (Q_d + U_d) / R_d
      local   <=>  t_local <= t_remote  (ties: the prefill worker of lowest index)

  Q_w: uncached prompt tokens sent to w whose prefill has not ended (as the router's
  `PrefillBacklog` counts them); R_p: p's reported `prefill_tokens_per_s`; T_link(N): the
  Cluster's transfer time of the whole prompt's KV (the decode side receives every prompt
  block, as the engine does); R_d from d's reports and the legs L the router has open on d
  (before this one):

      R_d = R_m                  L = 0: the prompt runs alone
      R_d = C / (s + C / R_m)    L > 0: each step carries C prompt tokens beside the streams

  R_m: d's marginal prefill rate, s: its decode step, C = min(U_d, its chunk), the chunk being
  the one d paces its prompts in (chunk_pacer.py; the whole prompt while d has timed no
  decode step). A worker that reports no rate counts at the mean of those reported (d without
  R_m at its `prefill_tokens_per_s`).
  While no worker has reported a rate (a run's first prompts) the router takes the workers as
  equally fast: a prompt runs locally when U_d <= T and Q_d + U_d <= max(T, min over p of
  (Q_p + U_p)), T = UNMEASURED_THRESHOLD, and a split one goes to the policy's prefill worker.
  The decision's TPOT-stall test never fires: `pdserve up` gives a split layout's decode
  workers `--slo-tpot-ms` = the router's target, so they pace and their stall needs no check.

Why the reported speeds and not the step costs: the router averages a worker's last 64 prompt
steps and its chunk beside the streams then (one block a step when the decode step nearly
fills the target), which a rate priced for this prompt misses; measured runs prefilled
locally what the step costs sent remote, and the other way round.

Not modelled: the router reads reports at its health checks (a second apart, step_window.py),
the KV-usage term of the least-loaded policy, and the link's measured estimate (the router
learns it from its recent hand-overs, else the prefill worker's report; here the Cluster's
wire time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.planner.simulate.step_window import Rates

DEFAULT_TPOT_TARGET_S = 0.1  # `pdserve up --slo-tpot-ms` default (100 ms)
BLOCK_TOKENS = 16  # the engine's KV block: a paced step's smallest prompt chunk
UNMEASURED_THRESHOLD = 256  # router/path_choice.py: the rule before any rate is reported


class SplitRule(StrEnum):
    REMOTE = "remote"
    LOCAL = "local"
    MEASURED = "measured"


@dataclass(frozen=True)
class Seen:
    """One worker as the router sees it at a decision: its reported speed, the uncached prompt
    tokens it was sent and has not prefilled (Q), the legs open on it (L: requests assigned and
    not finished, this one left out), and its paced chunk (None: whole prompts)."""

    rates: Rates
    backlog_tokens: int
    legs: int = 0
    chunk_tokens: int | None = None


@dataclass(frozen=True)
class Route:
    """One measured-rule decision: the two estimates (None before any rate was reported) and
    the prefill worker of t_remote (None: the routing policy's, before any rate)."""

    local: bool
    t_local_s: float | None
    t_remote_s: float | None
    prefill_index: int | None


def local_rate(decode: Seen, uncached: int, prior: float) -> float:
    """R_d (module docstring) for a prompt of `uncached` tokens; `prior` the mean reported
    rate."""
    r = decode.rates
    if r.marginal_tokens_per_s is None:
        return r.prefill_tokens_per_s or prior
    if not decode.legs:
        return r.marginal_tokens_per_s
    whole = max(uncached, 1)
    c = min(whole, decode.chunk_tokens or whole)
    return c / ((r.decode_step_s or 0.0) + c / r.marginal_tokens_per_s)


def route(uncached: int, decode: Seen, remote_uncached: Sequence[int],
          prefill: Sequence[Seen], link_s: float) -> Route:
    """The measured rule (module docstring): `uncached` tokens on `decode`,
    `remote_uncached[i]` on `prefill[i]` (non-empty); `link_s`: T_link(N)."""
    known = [w.rates.prefill_tokens_per_s for w in (decode, *prefill)
             if w.rates.prefill_tokens_per_s]
    if not known:
        mine = decode.backlog_tokens + uncached
        theirs = min(p.backlog_tokens + u for p, u in zip(prefill, remote_uncached, strict=True))
        local = uncached <= UNMEASURED_THRESHOLD and mine <= max(UNMEASURED_THRESHOLD, theirs)
        return Route(local, None, None, None)
    prior = sum(known) / len(known)
    each = [(p.backlog_tokens + u) / (p.rates.prefill_tokens_per_s or prior) + link_s
            for p, u in zip(prefill, remote_uncached, strict=True)]
    t_remote, best = min((t, i) for i, t in enumerate(each))
    t_local = (decode.backlog_tokens + uncached) / local_rate(decode, uncached, prior)
    return Route(t_local <= t_remote, t_local, t_remote, best)
