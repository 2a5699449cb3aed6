"""What an engine step costs, fitted from timed steps, in two parts:

    decode-only step:             s(D) = s0 + e D
    a step's prompt part:     t - s(D) = beta N + gamma P      (s(0) read as 0: no stream)

D the streams the step decoded, N its prompt tokens, P the (query, key) pairs they attend to (N
tokens after c computed ones: N c + N (N + 1) / 2). Each is least squares over the steps given,
with two unknowns: with S_xy the sums of products of the two regressors x1, x2 and the time y,

    c1 = (S_22 S_1y - S_12 S_2y) / det,   c2 = (S_11 S_2y - S_12 S_1y) / det,
    det = S_11 S_22 - S_12^2

(x1 = 1, x2 = D for the decode step; x1 = N, x2 = P for the prompt part, through the origin).
Where the steps cannot tell the two apart (det ~ 0: every batch alike, every chunk alike, traces
without pairs) or the fit is not a cost (a negative term), the fallback is one term: s(D) = the
median decode-only step, beta = sum part / sum N (one over the flat marginal rate) with gamma
= 0. The fit holds where the steps were: a chunk whose tokens attend to more keys on average, p
+ (N + 1) / 2 after p computed tokens, than the widest of the fitted steps (S = max P / N) is
priced at S, so that a gamma fitted on short prompts is never stretched over a long one (noise
on a small P, multiplied by a large one, would shrink the chunks without bound).

A worker paces its chunks with these (`workers/prefill_budget.py`), and the simulator its
simulated ones (`planner/simulate`); both ask `misses_ttft` whether a queue of prompts would
have a first token past its target at a pace of one chunk a step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def fit_two(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(c1, c2) of y ~ c1 x1 + c2 x2 over rows (x1, x2, y); None when x1 and x2 cannot be told
    apart."""
    s11 = sum(a * a for a, _, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    s1y = sum(a * y for a, _, y in rows)
    s2y = sum(b * y for _, b, y in rows)
    det = s11 * s22 - s12 * s12
    if not det > 1e-9 * s11 * s22:
        return None
    return (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det


@dataclass(frozen=True)
class DecodeCost:
    """s(D) above: s0 (> 0) and e (>= 0) seconds."""

    fixed_s: float
    per_stream_s: float = 0.0

    def at(self, streams: int) -> float:
        """The decode part of a step beside `streams` streams (0 with none)."""
        return self.fixed_s + self.per_stream_s * streams if streams else 0.0


def fit_decode_cost(rows: Sequence[tuple[int, float]]) -> DecodeCost | None:
    """s(D) from decode-only steps (D >= 1, t > 0); None without any."""
    if not rows:
        return None
    fit = fit_two([(1.0, d, t) for d, t in rows])
    if fit is not None and fit[0] > 0 and fit[1] >= 0:
        return DecodeCost(*fit)
    return DecodeCost(statistics.median(t for _, t in rows))


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
    """The prompt part from steps (N, P, t - s(D)), each with N > 0 and a positive part; None
    without any."""
    if not rows:
        return None
    fit = fit_two(rows)
    if fit is not None and fit[0] > 0 and fit[1] >= 0:
        return PromptCost(*fit, max(p / n for n, p, _ in rows))
    return PromptCost(sum(y for _, _, y in rows) / sum(n for n, _, _ in rows))


def misses_ttft(queue: Iterable[tuple[float, int]], now: float, chunk: int, step_s: float,
                ttft_target_s: float) -> bool:
    """Whether a prompt of `queue` (`Scheduler.prompt_queue`) would have its first token past the
    target in chunks of `chunk` tokens, one per step of `step_s`."""
    return any(now - arrival + math.ceil(left / chunk) * step_s > ttft_target_s
               for arrival, left in queue)
