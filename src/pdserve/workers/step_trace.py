"""The worker's recent engine steps, for timelines: when each ran and what it computed.

A bounded ring (the last `capacity` steps), always on: one tuple per step, recorded by the
engine thread, read by `GET /internal/steps?since=T` (its "fields" are `Step._fields`). Times are
wall-clock seconds (`time.time()`) so traces of several workers on one machine line up. The
endpoint also returns the worker's roles over the same interval ("roles": the role in force at
`since` and each change after it, `workers/role_history.py`), so each step's role is known.

Fields after the times are the step's `StepStats` (`Engine.take_step_stats`): prompt tokens
computed, decode tokens, requests in the batch, and decode_context, the summed context of the
decode requests (prompt + output so far, the new token included; 0 when there is no decode
token), and prefill_attention, the (query, key) pairs of the step's prompt tokens (each prompt's
n new tokens after c computed: n x c + n (n + 1) / 2). Traces written before decode_context or
prefill_attention existed have 5 or 6 fields; planner/simulate/step_fit.py reads all three.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import NamedTuple

from pdserve.engine.outputs import StepStats

DEFAULT_CAPACITY = 100_000


class Step(NamedTuple):
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int
    decode_context: int
    prefill_attention: int

    @classmethod
    def of(cls, start: float, end: float, stats: StepStats) -> Step:
        return cls(start, end, stats.prefill_tokens, stats.decode_tokens, stats.num_requests,
                   stats.decode_context, stats.prefill_attention)


class StepTrace:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._steps: deque[Step] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def record(self, step: Step) -> None:
        with self._lock:
            self._steps.append(step)

    def since(self, t: float) -> list[Step]:
        """Steps that ended after wall-clock time `t`, oldest first."""
        with self._lock:
            return [s for s in self._steps if s.end > t]

    def newest_first(self, limit: int) -> list[Step]:
        """The last `limit` steps, newest first."""
        with self._lock:
            return list(itertools.islice(reversed(self._steps), limit))
