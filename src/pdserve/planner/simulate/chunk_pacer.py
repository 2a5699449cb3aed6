"""The chunk a decode worker prefills its local prompts in, as the worker sets it: from its own
recent steps, not from the step costs (workers/prefill_budget.py, modelled here: the simulator
does not import the serving code).

    C = max(block, largest N with s + beta N + gamma (N p + N (N + 1) / 2) <= a)

s: the median of the last WINDOW decode-only steps; beta and gamma: a prompt step's cost per
token and per attended pair, fitted (common/prompt_cost.py) to the last WINDOW steps that
computed N > 0 prompt tokens in t seconds less d = s for a step that also decoded, else 0; both
read every REFRESH_S of simulated time. p: the tokens of the step's first prompt already
computed (or reused from the prefix cache). Until a decode-only step ran there is no cap
(None); until a prompt step ran, one block. a: the step's allowance, the TPOT target, or with
an ITL ceiling L above it min(L, TPOT + max(0, B)), B the credit the streams' gaps left of the
target (each step that decoded adds TPOT - its seconds, within +-BURST_STEPS x (L - TPOT)).

The router does not see p or the fit: the chunk it counts for a worker (`chunk_of(rates)`) is
the flat one, (a - s) x R_m from the rates it last read.

Lifetime: one per simulated decode worker; `record` after each of its steps, `chunk(now, p)`
when a step beside streams is planned.
"""

from __future__ import annotations

from pdserve.common.prompt_cost import PromptCost
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
        self.cost: PromptCost | None = None
        self.refresh_at = 0.0

    def record(self, prompt_tokens: int, decodes: int, seconds: float, pairs: int = 0) -> None:
        """One finished step of this worker (`pairs`: its prompt tokens' attended pairs)."""
        self.steps.record(prompt_tokens, decodes, seconds, pairs)
        if decodes:
            credit = self.credit_s + self.tpot_target_s - seconds
            self.credit_s = min(self.burst_s, max(-self.burst_s, credit))

    def chunk(self, now: float, context: int = 0) -> int | None:
        """C at `now` (None: no cap) for a step whose first prompt has `context` tokens
        computed, its rates and cost read again once REFRESH_S has passed."""
        if self.rates is None or now >= self.refresh_at:
            self.rates = self.steps.rates()
            self.cost = self.steps.prompt_cost(self.rates.decode_step_s)
            self.refresh_at = now + REFRESH_S
        return self.chunk_of(self.rates, self.cost, context)

    def chunk_of(self, rates: Rates, cost: PromptCost | None = None, context: int = 0
                 ) -> int | None:
        """C from `rates` (the window's) and the credit now, at `cost` (None: the flat
        marginal rate of `rates`, what the router counts)."""
        s, rate = rates.decode_step_s, rates.marginal_tokens_per_s
        if s is None:
            return None
        if cost is None and rate is not None:
            cost = PromptCost(1 / rate)
        if cost is None:
            return self.block
        allowance = min(self.itl_target_s, self.tpot_target_s + max(0.0, self.credit_s))
        return max(self.block, cost.chunk(allowance - s, context))
