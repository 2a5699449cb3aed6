"""The chunk a decode worker prefills its local prompts in, as the worker sets it: from its own
recent steps, not from the step costs (workers/prefill_budget.py, modelled here: the simulator
does not import the serving code).

    C = max(block, largest N with s(D) + beta N + gamma (N p + N (N + 1) / 2) <= a)

s(D) = s0 + e D: the decode part of a step beside D streams, fitted to the last WINDOW
decode-only steps (their median where the batch never changed); beta and gamma: a prompt
step's cost per token and per attended pair, fitted to the last WINDOW steps that computed N >
0 prompt tokens in t seconds less s(D) for a step that also decoded D streams
(common/step_cost.py); all read every REFRESH_S of simulated time. D: the streams the step
decodes; p: the tokens of its first prompt already computed (or reused from the prefix cache).
Until a decode-only step ran there is no cap (None); until a prompt step ran, one block. a: the
step's allowance, the TPOT target, or with an ITL ceiling L above it min(L, TPOT + max(0, B)), B
the credit the streams' gaps left of the target (each step that decoded adds TPOT - its
seconds, within +-BURST_STEPS x (L - TPOT)); with a TTFT target, L whatever B while a prompt
waiting here would miss its first token at a (`common/step_cost.misses_ttft`).

The router sees neither D, p nor the fits: the chunk it counts for a worker (`chunk_of(rates)`)
is the flat one, (a - s) x R_m, s the median decode step and R_m the marginal rate it last read.

Lifetime: one per simulated decode worker; `record` after each of its steps, `chunk(now, D,
p)` when a step beside streams is planned.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.step_cost import DecodeCost, PromptCost, misses_ttft
from pdserve.planner.simulate.step_window import Rates, StepWindow

REFRESH_S = 0.5  # workers/prefill_budget.py REFRESH_S
BURST_STEPS = 8  # workers/prefill_budget.py BURST_STEPS


class ChunkPacer:
    """C above, from `steps` (the worker's StepWindow, which its reports read too)."""

    def __init__(self, tpot_target_s: float, block_tokens: int,
                 itl_target_s: float | None = None, ttft_target_s: float | None = None) -> None:
        self.tpot_target_s, self.block = tpot_target_s, block_tokens
        self.ttft_target_s = ttft_target_s
        self.itl_target_s = tpot_target_s if itl_target_s is None else itl_target_s
        self.burst_s = BURST_STEPS * (self.itl_target_s - tpot_target_s)
        self.credit_s = 0.0
        self.steps = StepWindow()
        self.rates: Rates | None = None
        self.decode: DecodeCost | None = None
        self.cost: PromptCost | None = None
        self.refresh_at = 0.0

    def record(self, prompt_tokens: int, decodes: int, seconds: float, pairs: int = 0) -> None:
        """One finished step of this worker (`pairs`: its prompt tokens' attended pairs)."""
        self.steps.record(prompt_tokens, decodes, seconds, pairs)
        if decodes:
            credit = self.credit_s + self.tpot_target_s - seconds
            self.credit_s = min(self.burst_s, max(-self.burst_s, credit))

    def chunk(self, now: float, streams: int = 1, context: int = 0,
              queue: Sequence[tuple[float, int]] = ()) -> int | None:
        """C at `now` (None: no cap) for a step beside `streams` streams whose first prompt has
        `context` tokens computed, the prompts of `queue` waiting (each its arrival and the
        prompt tokens left up to its own), its costs read again once REFRESH_S has passed."""
        if self.rates is None or now >= self.refresh_at:
            self.rates = self.steps.rates()
            self.decode = self.steps.decode_cost()
            self.cost = self.steps.prompt_cost(self.decode)
            self.refresh_at = now + REFRESH_S
        if self.decode is None:
            return None
        if self.cost is None:
            return self.block
        a, s = self._allowance(), self.decode.at(max(1, streams))
        chunk = max(self.block, self.cost.chunk(a - s, context))
        if self.ttft_target_s is None or a >= self.itl_target_s or \
                not misses_ttft(queue, now, chunk, a, self.ttft_target_s):
            return chunk
        return max(self.block, self.cost.chunk(self.itl_target_s - s, context))

    def chunk_of(self, rates: Rates) -> int | None:
        """C as the router counts it from `rates` (the last it read): (a - s) x R_m, the median
        decode step and the flat marginal rate."""
        s, rate = rates.decode_step_s, rates.marginal_tokens_per_s
        if s is None:
            return None
        if rate is None:
            return self.block
        return max(self.block, PromptCost(1 / rate).chunk(self._allowance() - s, 0))

    def _allowance(self) -> float:
        return min(self.itl_target_s, self.tpot_target_s + max(0.0, self.credit_s))
