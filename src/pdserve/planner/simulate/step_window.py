"""A simulated worker's recent steps, and the speed it reports from them: what a served worker
puts in its signed /health as `rates` (workers/step_rates.py, workers/prefill_budget.py,
restated here: the simulator imports no serving code). The router's split rule and a decode
worker's paced chunk read these, not the step costs, as the served ones do.

- `prefill_tokens_per_s` = sum N / sum t over the last WINDOW steps that computed N > 0 prompt
  tokens in t seconds (steps that also decoded count whole);
- `decode_step_s`: the median of the last WINDOW decode-only steps;
- `marginal_tokens_per_s` (R_m): sum N / sum (t - d) over those prompt steps, d = the decode
  step for a step that also decoded, else 0 (parts of 0 or less left out);
- and, for a decode worker's own chunks only (not reported), the decode step fitted to its
  streams and the prompt cost per token and per attended pair fitted to the prompt steps less
  it (`common/step_cost.py`).

Each is None until a step of its kind ran. The router reads them at its health checks, a
second apart (routing.py `poll`), so its view is up to one interval older than these.

Lifetime: one per simulated worker that prefills; `record` after each of its steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from pdserve.common.step_cost import DecodeCost, PromptCost, fit_decode_cost, fit_prompt_cost

WINDOW = 64  # workers/step_rates.py WINDOW


@dataclass(frozen=True)
class Rates:
    """The three above (each None or positive)."""

    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    marginal_tokens_per_s: float | None = None


class StepWindow:
    """Invariant: `decode` and `prompt` hold the newest WINDOW steps of each kind."""

    def __init__(self) -> None:
        self.decode: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (D, t)
        # (N, t, D, P): prompt tokens, seconds, streams decoded beside them, attended pairs
        self.prompt: deque[tuple[int, float, int, int]] = deque(maxlen=WINDOW)

    def record(self, prompt_tokens: int, decodes: int, seconds: float, pairs: int = 0) -> None:
        """One finished step of this worker (a step of no positive length is not timed)."""
        if seconds <= 0:
            return
        if prompt_tokens:
            self.prompt.append((prompt_tokens, seconds, decodes, pairs))
        elif decodes:
            self.decode.append((decodes, seconds))

    def decode_step_s(self) -> float | None:
        return statistics.median(t for _, t in self.decode) if self.decode else None

    def marginal_rate(self, decode_step_s: float | None) -> float | None:
        """R_m with the decode part `decode_step_s` (None: 0) taken off the mixed steps."""
        parts = self._parts(DecodeCost(decode_step_s or 0.0))
        seconds = sum(part for _, _, part in parts)
        return sum(n for n, _, _ in parts) / seconds if seconds > 0 else None

    def decode_cost(self) -> DecodeCost | None:
        """s(D) fitted to the decode-only steps."""
        return fit_decode_cost(list(self.decode))

    def prompt_cost(self, decode: DecodeCost | None) -> PromptCost | None:
        """The prompt cost fitted to the prompt steps less `decode` at their streams."""
        return fit_prompt_cost(self._parts(decode or DecodeCost(0.0)))

    def _parts(self, decode: DecodeCost) -> list[tuple[int, int, float]]:
        """(N, P, t - s(D)) of the prompt steps whose part is positive."""
        parts = [(n, p, t - decode.at(d)) for n, t, d, p in self.prompt]
        return [part for part in parts if part[2] > 0]

    def rates(self) -> Rates:
        seconds = sum(t for _, t, _, _ in self.prompt)
        whole = sum(n for n, _, _, _ in self.prompt) / seconds if seconds > 0 else None
        s = self.decode_step_s()
        return Rates(whole, s, self.marginal_rate(s))
