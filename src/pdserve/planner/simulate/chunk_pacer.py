"""The chunk a decode worker prefills its local prompts in, as the worker sets it: from its own
recent steps, not from the step costs (workers/prefill_budget.py, modelled here: the simulator
does not import the serving code).

    C = max(block, floor((tpot - s) x R)),  recomputed every REFRESH_S of simulated time,

s: the median of the last WINDOW decode-only steps; R: sum N / sum (t - d) over the last WINDOW
steps that computed N > 0 prompt tokens in t seconds, d = s for a step that also decoded, else
0. Until a decode-only step ran there is no cap (None); until a prompt step ran, one block. C is
what the worker reports (`chunk_of`: the router's view).

The chunk a step takes (`tokens`) is priced by where it falls in its prompt, as the worker's
engine sizes it (common/prefill_pace.py): the longest N whose a x N + b x P fits tpot - s, the
same steps' prompt parts fitted per token (a) and per attended (query, key) pair (b, P = N x
c + N (N + 1) / 2 after c computed tokens). At the one rate R a chunk early in a long prompt
ended under the target and a late one over it; priced apart, each lands at it. Where s leaves
no time of the target, C (one block).

Lifetime: one per simulated decode worker; `record` after each of its steps, `tokens(now,
computed)` when a step beside streams is planned.
"""

from __future__ import annotations

import math

from pdserve.common.prefill_pace import PrefillPace
from pdserve.planner.simulate.step_window import Rates, StepWindow

REFRESH_S = 0.5  # workers/prefill_budget.py REFRESH_S


class ChunkPacer:
    """C and the pace above, from `steps` (the worker's StepWindow, which its reports read
    too)."""

    def __init__(self, tpot_target_s: float, block_tokens: int) -> None:
        self.tpot_target_s, self.block = tpot_target_s, block_tokens
        self.steps = StepWindow()
        self.current: int | None = None
        self.pace: PrefillPace | None = None
        self.refresh_at = 0.0

    def record(self, prompt_tokens: int, decodes: int, seconds: float, pairs: int = 0) -> None:
        """One finished step of this worker; `pairs`: its prompt tokens' attended pairs."""
        self.steps.record(prompt_tokens, decodes, seconds, pairs)

    def chunk(self, now: float) -> int | None:
        """C at `now` (None: no cap), recomputed once REFRESH_S has passed since the last."""
        if now >= self.refresh_at:
            rates = self.steps.rates()
            self.current = self.chunk_of(rates)
            self.pace = self._pace_of(rates) if self.current is not None else None
            self.refresh_at = now + REFRESH_S
        return self.current

    def tokens(self, now: float, computed: int) -> int | None:
        """The chunk a step beside streams takes of a prompt `computed` tokens in (None: no
        cap)."""
        cap = self.chunk(now)
        return self.pace.tokens(computed) if self.pace is not None else cap

    def _pace_of(self, rates: Rates) -> PrefillPace | None:
        s = rates.decode_step_s
        if s is None or s >= self.tpot_target_s:
            return None
        costs = self.steps.prompt_costs(s)
        return None if costs is None else PrefillPace(self.tpot_target_s - s, *costs, self.block)

    def chunk_of(self, rates: Rates) -> int | None:
        """C from `rates` (the window's), as the worker's refresh would set it and its /health
        report it."""
        s, rate = rates.decode_step_s, rates.marginal_tokens_per_s
        if s is None:
            return None
        if rate is None:
            return self.block
        return max(self.block, math.floor(round((self.tpot_target_s - s) * rate, 6)))
