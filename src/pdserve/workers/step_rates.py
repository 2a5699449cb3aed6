"""What a worker's recent engine steps say about its speed, for the router's split decision.

Reported in the signed `/health` as `"rates"` (`StepRates.to_json`), read from the step trace
(`step_trace.py`) at each health check; nothing is measured twice.

- `prefill_tokens_per_s` = sum N / sum t over the last `window` steps that computed prompt
  tokens (N = prompt tokens computed, t = the step's duration). Steps that also decoded count
  whole, so a collocated or decode worker's rate is the rate at which a prompt progresses
  beside its running streams: the one its local prefills get. None before any such step.
- `decode_step_s`: the median duration of the last `window` decode-only steps (one token for
  every running stream): the floor of this worker's inter-token latency. None before any.

Lifetime: a snapshot; stale by one health interval at most.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.workers.step_trace import Step

WINDOW = 64  # steps of each kind looked at: recent enough to follow load, enough to be stable
SCAN = 4096  # newest steps read per report, whatever they hold (bounds a health check's work)


@dataclass(frozen=True)
class StepRates:
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_step_s": self.decode_step_s}


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
