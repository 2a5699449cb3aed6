"""A simulated worker's recent steps, and the speed it reports from them: what a served worker
puts in its signed /health as `rates` (workers/step_rates.py, workers/prefill_budget.py,
restated here: the simulator imports no serving code). The router's split rule and a decode
worker's paced chunk read these, not the step costs, as the served ones do.

- `prefill_tokens_per_s` = sum N / sum t over the last WINDOW steps that computed N > 0 prompt
  tokens in t seconds (steps that also decoded count whole);
- `decode_step_s`: the median of the last WINDOW decode-only steps;
- `marginal_tokens_per_s` (R_m): sum N / sum (t - d) over those prompt steps, d = the decode
  step for a step that also decoded, else 0 (parts of 0 or less left out).

Each is None until a step of its kind ran. The router reads them at its health checks, a
second apart (routing.py `poll`), so its view is up to one interval older than these.

Lifetime: one per simulated worker that prefills; `record` after each of its steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 64  # workers/step_rates.py WINDOW


@dataclass(frozen=True)
class Rates:
    """The three above (each None or positive)."""

    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    marginal_tokens_per_s: float | None = None


class StepWindow:
    """Invariant: `decode_s` and `prompt` hold the newest WINDOW steps of each kind."""

    def __init__(self) -> None:
        self.decode_s: deque[float] = deque(maxlen=WINDOW)
        self.prompt: deque[tuple[int, float, bool]] = deque(maxlen=WINDOW)  # (N, t, decoded)

    def record(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        """One finished step of this worker (a step of no positive length is not timed)."""
        if seconds <= 0:
            return
        if prompt_tokens:
            self.prompt.append((prompt_tokens, seconds, decodes > 0))
        elif decodes:
            self.decode_s.append(seconds)

    def decode_step_s(self) -> float | None:
        return statistics.median(self.decode_s) if self.decode_s else None

    def marginal_rate(self, decode_step_s: float | None) -> float | None:
        """R_m with the decode part `decode_step_s` (None: 0) taken off the mixed steps."""
        d = decode_step_s or 0.0
        parts = [(n, t - d if decoded else t) for n, t, decoded in self.prompt]
        seconds = sum(part for _, part in parts if part > 0)
        return sum(n for n, part in parts if part > 0) / seconds if seconds > 0 else None

    def rates(self) -> Rates:
        seconds = sum(t for _, t, _ in self.prompt)
        whole = sum(n for n, _, _ in self.prompt) / seconds if seconds > 0 else None
        s = self.decode_step_s()
        return Rates(whole, s, self.marginal_rate(s))
