"""Streams a worker handed back while changing role, parked: their engine requests hold their
blocks (`Engine.park`) so that the router's continuation can take the KV as it is
(`LegRequest.resume`) instead of computing it again.

Lifetime: a parked request is taken by the first resumed PREFILL leg naming its leg, or
released once `PARK_S` has passed without one (the router continued elsewhere, or went away):
its blocks go back to the pool then, their KV kept in the prefix cache. Threading: the engine
thread only.
"""

from __future__ import annotations

import time

# Long enough for a router to pick a decode worker and send the continuation's legs (a few
# milliseconds; longer while it waits for a decode slot), short enough that KV nobody claims
# goes back soon.
PARK_S = 10.0


class ParkedLegs:
    def __init__(self, park_s: float = PARK_S) -> None:
        if not park_s > 0:
            raise ValueError(f"park_s must be > 0 seconds, got {park_s!r}")
        self.park_s = park_s
        self._by_leg: dict[str, tuple[str, float]] = {}  # leg id -> (engine id, deadline)

    def __len__(self) -> int:
        return len(self._by_leg)

    def add(self, leg_id: str, engine_id: str) -> None:
        self._by_leg[leg_id] = (engine_id, time.monotonic() + self.park_s)

    def take(self, leg_id: str) -> str | None:
        """The engine id parked for `leg_id`, now no longer parked; None if there is none."""
        parked = self._by_leg.pop(leg_id, None)
        return None if parked is None else parked[0]

    def expired(self) -> list[str]:
        """Engine ids whose time ran out, no longer parked: the caller releases them."""
        now = time.monotonic()
        gone = [leg for leg, (_, deadline) in self._by_leg.items() if deadline <= now]
        return [self._by_leg.pop(leg)[0] for leg in gone]

    def all(self) -> list[str]:
        """Every parked engine id, no longer parked (the loop fails every leg, or a new flip
        begins: what the last one parked had its time)."""
        ids = [engine_id for engine_id, _ in self._by_leg.values()]
        self._by_leg.clear()
        return ids
