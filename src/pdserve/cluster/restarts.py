"""When a supervisor restarts a child that died while serving: a budget per time window and a
growing backoff.

`RestartPolicy` is the rule, for every restartable child alike: a child that exits while
serving is started again after a backoff (FIRST_BACKOFF_S, doubling with each exit in a row, at
most MAX_BACKOFF_S), unless this exit is more than `max_restarts` within the last `window_s`
seconds: then the cluster stops. A child that ran at least `window_s` before it exited counts
as having been healthy: its backoff starts again from the first. So a rare crash is restarted
for ever, and a crash loop ends after `max_restarts` restarts without spinning.

`RestartHistory` is the record of one child (by name) over the supervisor's life; it outlives
each process of that child.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MAX_RESTARTS = 5  # of one child within RESTART_WINDOW_S
RESTART_WINDOW_S = 300.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` restarts of a child within any `window_s` seconds; each after
    `backoff_s` doubled per exit in a row, capped at `max_backoff_s`."""

    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    backoff_s: float = FIRST_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"the restart window must be > 0 seconds, got {self.window_s}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s} "
                             f"and {self.max_backoff_s}")

    def describe(self) -> str:
        return f"at most {self.max_restarts} restarts within {self.window_s:g} s"


class RestartHistory:
    """The exits of one restartable child: those within the window, and the run of exits."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._exits: deque[tuple[float, int]] = deque()  # (monotonic time, exit code)
        self._in_a_row = 0

    def record(self, code: int, lived_s: float, now: float) -> float | None:
        """Note an exit after `lived_s` of running; the backoff before the restart, or None
        when this exit is over the budget (stop)."""
        p = self._policy
        self._exits.append((now, code))
        while self._exits[0][0] <= now - p.window_s:
            self._exits.popleft()
        if lived_s >= p.window_s:
            self._in_a_row = 0
        if len(self._exits) > p.max_restarts:
            return None
        delay = min(p.backoff_s * 2 ** self._in_a_row, p.max_backoff_s)
        self._in_a_row += 1
        return delay

    @property
    def in_window(self) -> int:
        """Exits within the window, the last one included (that many restarts if allowed)."""
        return len(self._exits)

    @property
    def codes(self) -> list[int]:
        """Exit codes within the window, oldest first."""
        return [code for _, code in self._exits]
