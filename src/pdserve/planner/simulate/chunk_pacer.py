"""The chunk a decode worker prefills its local prompts in, as the worker sets it: from its own
recent steps, not from the step costs (workers/prefill_budget.py, modelled here: the simulator
does not import the serving code).

    C = max(block, floor((tpot - s) x R)),  recomputed every REFRESH_S of simulated time,

s: the median of the last WINDOW decode-only steps; R: sum N / sum (t - d) over the last WINDOW
steps that computed N > 0 prompt tokens in t seconds, d = s for a step that also decoded, else
0. Until a decode-only step ran there is no cap (None); until a prompt step ran, one block.

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


class ChunkPacer:
    """C above, from `steps` (the worker's StepWindow, which its reports read too)."""

    def __init__(self, tpot_target_s: float, block_tokens: int) -> None:
        self.tpot_target_s, self.block = tpot_target_s, block_tokens
        self.steps = StepWindow()
        self.current: int | None = None
        self.refresh_at = 0.0

    def record(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        """One finished step of this worker."""
        self.steps.record(prompt_tokens, decodes, seconds)

    def chunk(self, now: float) -> int | None:
        """C at `now` (None: no cap), recomputed once REFRESH_S has passed since the last."""
        if now >= self.refresh_at:
            self.current = self.chunk_of(self.steps.rates())
            self.refresh_at = now + REFRESH_S
        return self.current

    def chunk_of(self, rates: Rates) -> int | None:
        """C from `rates` (the window's), as the worker's refresh would set it and its /health
        report it."""
        s, rate = rates.decode_step_s, rates.marginal_tokens_per_s
        if s is None:
            return None
        if rate is None:
            return self.block
        return max(self.block, math.floor(round((self.tpot_target_s - s) * rate, 6)))
