"""What a worker's recent engine steps say about its speed, for the router's split decision.

Reported in the signed `/health` as `"rates"` (`StepRates.to_json`), read from the step trace
(`step_trace.py`) at each health check; nothing is measured twice.

- `prefill_tokens_per_s` = sum N / sum t over the last `window` steps that computed prompt
  tokens (N = prompt tokens computed, t = the step's duration). Steps that also decoded count
  whole, so a collocated or decode worker's rate is the rate at which its last prompts
  progressed beside the streams running then, however long ago (not measured again while no
  prompt runs here). None before any such step.
- `decode_step_s`: the median duration of the last `window` decode-only steps (one token for
  every running stream): the floor of this worker's inter-token latency. None before any.
- `prefill_marginal_tokens_per_s` (R_m): sum N / sum (t - s) over the same recent steps that
  computed N prompt tokens in t seconds, s = `decode_step_s` taken off only for steps that also
  decoded (`prefill_budget.marginal_prefill_rate`, the rate the worker paces its chunks with):
  a prompt's own cost, without the decode part of mixed steps, so it does not depend on the
  streams that ran beside the last prompts. Absent from the JSON until measured.

Lifetime: a snapshot; stale by one health interval at most.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.workers.step_trace import Step

WINDOW = 64  # steps of each kind looked at: recent enough to follow load, enough to be stable
SCAN = 4096  # newest steps read per report, whatever they hold (bounds a health check's work)


@dataclass(frozen=True)
class StepRates:
    """The rates above; each None until measured (then positive and finite)."""

    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    prefill_marginal_tokens_per_s: float | None = None  # R_m; None: no prompt step timed

    def to_json(self) -> dict[str, float | None]:
        """The health report's `rates`: the first two always (None until measured), R_m only
        once measured (a reader without it falls back on `prefill_tokens_per_s`)."""
        out = {"prefill_tokens_per_s": self.prefill_tokens_per_s,
               "decode_step_s": self.decode_step_s}
        if self.prefill_marginal_tokens_per_s is not None:
            out["prefill_marginal_tokens_per_s"] = self.prefill_marginal_tokens_per_s
        return out


def step_rates(newest_first: Iterable[Step], window: int = WINDOW) -> StepRates:
    """Rates from steps given newest first (`StepTrace.newest_first(SCAN)`)."""
    tokens, seconds, decode = 0, 0.0, []
    prefill_steps = 0
    for step in newest_first:
        duration = step.end - step.start
        if duration <= 0:
            continue
        if step.prefill_tokens and prefill_steps < window:
            tokens, seconds, prefill_steps = tokens + step.prefill_tokens, \
                seconds + duration, prefill_steps + 1
        elif not step.prefill_tokens and step.decode_tokens and len(decode) < window:
            decode.append(duration)
        if prefill_steps >= window and len(decode) >= window:
            break
    return StepRates(tokens / seconds if seconds > 0 else None,
                     statistics.median(decode) if decode else None)


def reported_rates(newest_first: Iterable[Step], window: int = WINDOW) -> StepRates:
    """`step_rates` with R_m, all over the same steps (given newest first): what `/health`
    reports. R_m takes off the decode part measured here, `decode_step_s`."""
    # prefill_budget builds on this module (WINDOW, step_rates): imported here, not above
    from pdserve.workers.prefill_budget import marginal_prefill_rate

    steps = list(newest_first)
    rates = step_rates(steps, window)
    marginal = marginal_prefill_rate(steps, rates.decode_step_s, window)
    return dataclasses.replace(rates, prefill_marginal_tokens_per_s=marginal)
