"""A worker's roles over time, for timelines and time-in-role accounting: the role it started
in and each completed role change (`workers/role_flip.py`), returned beside the engine steps by
`GET /internal/steps` (its "roles").

A span is a role from the moment the worker took it until the next span's `since`: the role
changes when a flip completes, so the drain before it (`flip_seconds`, from the command to
`since`) ran in the old role, taking no new legs. Times are wall-clock seconds (`time.time()`),
like the step trace's, so several workers' histories and steps line up.

Bounded: the last `capacity` spans are kept (one per change; a worker that flips every few
seconds for days still fits); the oldest kept one's `from_role` says which role came before.
Threading: the engine thread records (`RoleFlip.advance`), the HTTP thread reads; a lock.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, NamedTuple

from pdserve.common.engine_options import Role

DEFAULT_CAPACITY = 10_000


class RoleSpan(NamedTuple):
    role: Role
    since: float  # wall clock: when the worker took this role
    from_role: Role | None  # the role before; None for the role it started in
    flip_seconds: float | None  # from the flip's command to `since`; None for the start

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role.value, "since": self.since,
                "from": None if self.from_role is None else self.from_role.value,
                "flip_seconds": self.flip_seconds}


class RoleHistory:
    def __init__(self, role: Role, since: float, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a role history keeps at least 1 span, got capacity {capacity}")
        self._spans: deque[RoleSpan] = deque([RoleSpan(role, since, None, None)],
                                             maxlen=capacity)
        self._lock = threading.Lock()

    @property
    def current(self) -> RoleSpan:
        with self._lock:
            return self._spans[-1]

    def changed(self, to_role: Role, at: float, flip_seconds: float) -> None:
        """The worker serves in `to_role` from wall-clock time `at`, after a flip that took
        `flip_seconds` from its command."""
        with self._lock:
            self._spans.append(RoleSpan(to_role, at, self._spans[-1].role, flip_seconds))

    def since(self, t: float) -> list[RoleSpan]:
        """The span in force at wall-clock time `t` and every later one, oldest first (all kept
        spans when `t` is before the oldest kept one); never empty."""
        with self._lock:
            spans = list(self._spans)
        first = max((i for i, s in enumerate(spans) if s.since <= t), default=0)
        return spans[first:]
