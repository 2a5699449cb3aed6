"""What a prompt step costs beyond the streams beside it, fitted from timed steps:

    t - d = beta N + gamma P

N the step's prompt tokens, P the (query, key) pairs they attend to (N tokens after c computed
ones: N c + N (N + 1) / 2), t - d the step's time less its decode part. Least squares through
the origin over the steps given: with S_xy the sums of products over them,

    beta  = (S_PP S_Ny - S_NP S_Py) / D,   gamma = (S_NN S_Py - S_NP S_Ny) / D,
    D = S_NN S_PP - S_NP^2

Where the steps cannot tell the two terms apart (D ~ 0: every step alike, or traces without
pairs) or the fit is not a cost (beta <= 0 or gamma < 0), gamma = 0 and beta = sum (t - d) /
sum N, one over the flat marginal rate. The fit holds where the steps were: a chunk whose
tokens attend to more keys on average, p + (N + 1) / 2 after p computed tokens, than the widest
of the fitted steps (S = max P / N) is priced at S, so that a gamma fitted on short prompts is
never stretched over a long one (noise on a small P, multiplied by a large one, would shrink
the chunks without bound). A worker paces its chunks with it
(`workers/prefill_budget.py`), and the simulator its simulated ones (`planner/simulate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptCost:
    """beta (s a prompt token, > 0), gamma (s an attended pair, >= 0) and S (the most keys a
    fitted step's tokens attended to on average) above."""

    per_token_s: float
    per_pair_s: float = 0.0
    widest_span: float = math.inf

    def chunk(self, seconds: float, context: int) -> int:
        """The most prompt tokens after `context` computed ones whose cost fits in `seconds`
        (0 when none does): the positive root of gamma N^2 / 2 + q N = seconds, q = beta +
        gamma (context + 1/2), in its stable form 2 x seconds / (q + sqrt(q^2 + 2 gamma
        seconds)); past S, seconds / (beta + gamma S)."""
        if seconds <= 0:
            return 0
        q = self.per_token_s + self.per_pair_s * (context + 0.5)
        n = 2 * seconds / (q + math.sqrt(q * q + 2 * self.per_pair_s * seconds))
        if context + (n + 1) / 2 > self.widest_span:
            n = seconds / (self.per_token_s + self.per_pair_s * self.widest_span)
        return math.floor(round(n, 6))


def fit_prompt_cost(rows: Sequence[tuple[int, int, float]]) -> PromptCost | None:
    """The cost from steps (N, P, t - d), each with N > 0 and t - d > 0; None without any."""
    if not rows:
        return None
    snn = sum(n * n for n, _, _ in rows)
    snp = sum(n * p for n, p, _ in rows)
    spp = sum(p * p for _, p, _ in rows)
    sny = sum(n * y for n, _, y in rows)
    spy = sum(p * y for _, p, y in rows)
    det = snn * spp - snp * snp
    if det > 1e-9 * snn * spp:  # N and P vary apart: the two terms can be told apart
        beta, gamma = (spp * sny - snp * spy) / det, (snn * spy - snp * sny) / det
        if beta > 0 and gamma >= 0:
            return PromptCost(beta, gamma, max(p / n for n, p, _ in rows))
    return PromptCost(sum(y for _, _, y in rows) / sum(n for n, _, _ in rows))
