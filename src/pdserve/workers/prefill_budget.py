"""The prompt tokens a worker computes per step while streams decode on it, so that their steps
stay within the TPOT target (`pdserve worker --slo-tpot-ms`): a decode worker's local prefills
(conditional disaggregation chose them, `router/split_decision.py`) run in chunks beside its
streams instead of freezing them for a whole prompt.

    C = max(block_size, floor((tpot - s) x R))

s: the median decode-only step, the streams' own step (`step_rates.py`); R: the marginal prefill
rate, sum N / sum (t - d) over the last `WINDOW` steps that computed N > 0 prompt tokens, t
their duration and d = s for a step that also decoded (its decode part), else 0. A step with C
prompt tokens beside the streams then takes about s + C / R <= tpot. At least one block per
step, so a prompt always progresses (its streams then see up to s + block / R).

Until s is measured (no stream decoded here yet) there is nothing to protect: no cap. Until R
is measured, one block. With s at or over the target no chunk keeps a step within it: the
streams already miss it, a step beside them still carries one block, and a local prompt
advances a block a step; the worker says so in its log (`past_target`), since only its
operator can change it (a larger target, fewer streams per worker, more decode workers).

`C` is reported in the signed /health as `chunk_tokens`, the stall the router's decision
counts for one step of this worker.

Lifetime: recomputed from the step trace every `REFRESH_S` on the engine thread
(`EngineLoop`), applied to the following steps (`Engine.set_prefill_chunk`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pdserve.workers.step_rates import WINDOW, step_rates
from pdserve.workers.step_trace import Step

REFRESH_S = 0.5  # a few decode steps: follows a changing batch, costs nothing measurable


def marginal_prefill_rate(newest_first: list[Step], decode_step_s: float | None,
                          window: int = WINDOW) -> float | None:
    """R above; None before any step computed prompt tokens in measurable time."""
    tokens, seconds, counted = 0, 0.0, 0
    for step in newest_first:
        if not step.prefill_tokens:
            continue
        decode_part = (decode_step_s or 0.0) if step.decode_tokens else 0.0
        prompt_part = step.end - step.start - decode_part
        if prompt_part > 0:
            tokens, seconds, counted = tokens + step.prefill_tokens, seconds + prompt_part, \
                counted + 1
        if counted >= window:
            break
    return tokens / seconds if seconds > 0 else None


def past_target(tpot_target_s: float, newest_first: Iterable[Step]) -> float | None:
    """The median decode-only step s when it is at or over the target (no chunk can keep a
    step within it), else None (also while none was measured)."""
    decode_step = step_rates(newest_first).decode_step_s
    return decode_step if decode_step is not None and decode_step >= tpot_target_s else None


def prefill_chunk(tpot_target_s: float, newest_first: Iterable[Step], block_size: int
                  ) -> int | None:
    """C above, or None (no cap) while no decode step was measured."""
    steps = list(newest_first)
    decode_step = step_rates(steps).decode_step_s
    if decode_step is None:
        return None
    rate = marginal_prefill_rate(steps, decode_step)
    if rate is None:
        return block_size
    return max(block_size, math.floor(round((tpot_target_s - decode_step) * rate, 6)))
