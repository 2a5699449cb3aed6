"""The chunk a decode worker prefills its local prompts in, as the worker sets it: from its own
recent steps, not from the step costs (workers/prefill_budget.py, modelled here: the simulator
does not import the serving code).

    C = max(block, floor((a - s) x R)),  s and R read every REFRESH_S of simulated time,

s: the median of the last WINDOW decode-only steps; R: sum N / sum (t - d) over the last WINDOW
steps that computed N > 0 prompt tokens in t seconds, d = s for a step that also decoded, else
0. Until a decode-only step ran there is no cap (None); until a prompt step ran, one block.
a: the step's allowance, the TPOT target, or with an ITL ceiling L above it min(L, TPOT +
max(0, B)), B the credit the streams' gaps left of the target (each step that decoded adds
TPOT - its seconds, within +-BURST_STEPS x (L - TPOT)).

Why not the exact chunk that fills the target: R is an average over the chunks of earlier
prompts, early ones (little attention) and late ones (much) alike, so a chunk early in a long
prompt ends under the target and a late one over it: the served steps that pace a local
prefill take ~70-120 ms against a 100 ms target, and the streams' P99 ITL is past it.

Lifetime: one per simulated decode worker; `record` after each of its steps, `chunk(now)` when
a step beside streams is planned.
"""

from __future__ import annotations

import math

from pdserve.planner.simulate.step_window import Rates, StepWindow

REFRESH_S = 0.5  # workers/prefill_budget.py REFRESH_S
BURST_STEPS = 8  # workers/prefill_budget.py BURST_STEPS


class ChunkPacer:
    """C above, from `steps` (the worker's StepWindow, which its reports read too)."""

    def __init__(self, tpot_target_s: float, block_tokens: int,
                 itl_target_s: float | None = None) -> None:
        self.tpot_target_s, self.block = tpot_target_s, block_tokens
        self.itl_target_s = tpot_target_s if itl_target_s is None else itl_target_s
        self.burst_s = BURST_STEPS * (self.itl_target_s - tpot_target_s)
        self.credit_s = 0.0
        self.steps = StepWindow()
        self.rates: Rates | None = None
        self.refresh_at = 0.0

    def record(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        """One finished step of this worker."""
        self.steps.record(prompt_tokens, decodes, seconds)
        if decodes:
            credit = self.credit_s + self.tpot_target_s - seconds
            self.credit_s = min(self.burst_s, max(-self.burst_s, credit))

    def chunk(self, now: float) -> int | None:
        """C at `now` (None: no cap), its rates read again once REFRESH_S has passed."""
        if self.rates is None or now >= self.refresh_at:
            self.rates = self.steps.rates()
            self.refresh_at = now + REFRESH_S
        return self.chunk_of(self.rates)

    def chunk_of(self, rates: Rates) -> int | None:
        """C from `rates` (the window's) and the credit now, as the worker would set it and
        its /health report it."""
        s, rate = rates.decode_step_s, rates.marginal_tokens_per_s
        if s is None:
            return None
        if rate is None:
            return self.block
        allowance = min(self.itl_target_s, self.tpot_target_s + max(0.0, self.credit_s))
        return max(self.block, math.floor(round((allowance - s) * rate, 6)))
