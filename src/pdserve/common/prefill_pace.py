"""The prompt tokens a step beside decoding streams may compute: as many as fit the step's time
budget, priced by where in its prompt the chunk falls (set by the worker from its own steps:
`workers/prefill_budget.py`; the scheduler asks it per step, `scheduler.py`).

A step's prompt part (its time less the streams' decode part) is priced as

    a x N + b x P,    P = N x c + N (N + 1) / 2

N: the chunk's tokens, c: the prompt's tokens computed before it (cached, or earlier chunks),
P: the (query, key) pairs of its causal attention. a prices what every token costs wherever it
falls (the linear layers), b one attended position. A chunk late in a long prompt attends to
every position before it: at one average rate the first chunks of a 1,500-token prompt ended
well under the budget and the last ones over it (SmolLM2 on 2 cores beside 4-5 streams, a
100 ms target: median chunk steps of 84 ms from a prompt's start, 110 ms from 1,024 tokens in;
priced by position, 103 and 103 ms: docs/benchmarks.md). The chunk is the largest N within the
budget B:

    N = floor(2 B / (h + sqrt(h^2 + 2 b B))),   h = a + b (c + 1/2)

(the positive root of b N^2 / 2 + h N = B, written without the cancellation of
(sqrt(h^2 + 2 b B) - h) / b; B / a for b = 0), and at least one block, so that a prompt
always advances.

a and b come from measured steps (`fit_costs`): least squares of y = a x N + b x P over the
steps' (N, P, y), y a step's prompt part, by the normal equations of the two unknowns. Where
the steps cannot tell a from b (fewer than MIN_FIT of them, or all chunks at one place, P
proportional to N: the equations singular to SINGULAR) or the fit gives b < 0 or a <= 0, b = 0
and a = sum y / sum N: one average rate. The worker fits its own steps
(`workers/prefill_budget.py`), the simulator its simulated ones (`planner/simulate/
step_window.py`).

Invariants: budget_s > 0; token_s, pair_s >= 0 and not both 0; block >= 1.
Lifetime: one per refresh of the worker's rates; the scheduler holds the newest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_FIT = 8  # steps for a fit of two costs; fewer: one rate
SINGULAR = 1e-9  # normal equations this close to singular cannot tell a from b


@dataclass(frozen=True)
class PrefillPace:
    budget_s: float  # B: the step's time left beside the streams' decode part
    token_s: float  # a: seconds per prompt token
    pair_s: float  # b: seconds per attended (query, key) pair
    block: int  # the fewest tokens a chunk takes

    def __post_init__(self) -> None:
        for name in ("budget_s", "token_s", "pair_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.budget_s <= 0 or self.token_s + self.pair_s <= 0:
            raise ValueError(f"a pace needs a budget > 0 and a cost > 0, got {self!r}")
        if type(self.block) is not int or self.block < 1:
            raise ValueError(f"block must be an int >= 1, got {self.block!r}")

    def tokens(self, cached: int) -> int:
        """N above for a chunk after `cached` computed tokens of its prompt."""
        b, budget = self.pair_s, self.budget_s
        h = self.token_s + b * (cached + 0.5)
        n = 2 * budget / (h + math.sqrt(h * h + 2 * b * budget))
        return max(self.block, math.floor(round(n, 6)))

    def seconds(self, tokens: int, cached: int) -> float:
        """The prompt part of a chunk of `tokens` after `cached`: a x N + b x P."""
        return self.token_s * tokens + self.pair_s * (tokens * cached + tokens * (tokens + 1) / 2)


def fit_costs(rows: Sequence[tuple[int, int, float]]) -> tuple[float, float] | None:
    """(a, b) from steps' (N, P, y) with N > 0 and y > 0; None without any."""
    if not rows:
        return None
    one_rate = (sum(y for _, _, y in rows) / sum(n for n, _, _ in rows), 0.0)
    if len(rows) < MIN_FIT:
        return one_rate
    nn = sum(n * n for n, _, _ in rows)
    npp = sum(n * p for n, p, _ in rows)
    pp = sum(p * p for _, p, _ in rows)
    det = nn * pp - npp * npp
    if det <= SINGULAR * nn * pp:
        return one_rate
    ny, py = sum(n * y for n, _, y in rows), sum(p * y for _, p, y in rows)
    a, b = (ny * pp - py * npp) / det, (nn * py - npp * ny) / det
    return (a, b) if a > 0 and b >= 0 else one_rate
