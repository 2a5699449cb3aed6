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
import statistics
from collections import deque

REFRESH_S = 0.5  # workers/prefill_budget.py REFRESH_S
WINDOW = 64  # workers/step_rates.py WINDOW


class ChunkPacer:
    """C above. Invariant: `decode_s` and `prompt` hold the newest WINDOW steps of each kind."""

    def __init__(self, tpot_target_s: float, block_tokens: int) -> None:
        self.tpot_target_s, self.block = tpot_target_s, block_tokens
        self.decode_s: deque[float] = deque(maxlen=WINDOW)
        self.prompt: deque[tuple[int, float, bool]] = deque(maxlen=WINDOW)  # (N, t, decoded)
        self.current: int | None = None
        self.refresh_at = 0.0

    def record(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        """One finished step of this worker."""
        if prompt_tokens:
            self.prompt.append((prompt_tokens, seconds, decodes > 0))
        elif decodes:
            self.decode_s.append(seconds)

    def chunk(self, now: float) -> int | None:
        """C at `now` (None: no cap), recomputed once REFRESH_S has passed since the last."""
        if now >= self.refresh_at:
            self.current = self._compute()
            self.refresh_at = now + REFRESH_S
        return self.current

    def _compute(self) -> int | None:
        if not self.decode_s:
            return None
        s = statistics.median(self.decode_s)
        parts = [(n, t - s if decoded else t) for n, t, decoded in self.prompt]
        tokens = sum(n for n, part in parts if part > 0)
        seconds = sum(part for _, part in parts if part > 0)
        if seconds <= 0:
            return self.block
        return max(self.block, math.floor(round((self.tpot_target_s - s) * tokens / seconds, 6)))
