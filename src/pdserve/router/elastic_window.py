"""The elastic controller's arrival window: the prompts the router sent each worker to prefill
over a recent stretch of time, from which `elastic.py` takes arrival rates (prompt tokens per
second) and the mean prompt.

Each tick samples the router's running totals (`PrefillBacklog.sent`). The window ends at the
newest sample and starts at the newest older one that leaves it at least `min_s` long (the
controller's sustain window: the evidence a flip wants anyway) and holding at least
`MIN_PROMPTS` prompts sent anywhere; failing that, at the oldest sample kept (about `MAX_S`
back). So a rate is estimated from MIN_PROMPTS arrivals whenever the past holds them, however
far apart they come (a Poisson stream's estimate from n arrivals is off by ~1/sqrt(n): 35% at
8; at 0.4 req/s the window spans about 20 s), and a busy stream is followed within `min_s`
(chat at 3 req/s). The gap between two prompts of a steady stream is then a small part of the
window, never all of it: a lull does not read as idleness. A startup burst leaves the window
once MIN_PROMPTS later prompts came.

Lifetime: one per controller, from its start; samples are dropped once a newer one is MAX_S
old.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.router.split_decision import Sent

MIN_PROMPTS = 8
MAX_S = 60.0


@dataclass(frozen=True)
class Window:
    """What the router sent each worker to prefill within the last `seconds` (0: no window
    yet, a single sample)."""

    seconds: float = 0.0
    sent: Mapping[str, Sent] = field(default_factory=dict)


class ArrivalWindow:
    def __init__(self, min_prompts: int = MIN_PROMPTS, max_s: float = MAX_S) -> None:
        if type(min_prompts) is not int or min_prompts < 1:
            raise ValueError(f"min_prompts must be an int >= 1, got {min_prompts!r}")
        if not max_s > 0:
            raise ValueError(f"max_s must be > 0 seconds, got {max_s!r}")
        self.min_prompts, self.max_s = min_prompts, max_s
        self._samples: deque[tuple[float, dict[str, Sent]]] = deque()

    def sample(self, now: float, totals: Mapping[str, Sent]) -> None:
        """The running totals at monotonic time `now` (later than the last sample's)."""
        self._samples.append((now, dict(totals)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.max_s:
            self._samples.popleft()

    def window(self, min_s: float) -> Window:
        """The window ending at the newest sample (see the module docstring)."""
        if len(self._samples) < 2:
            return Window()
        end, totals = self._samples[-1]
        start, before = self._samples[0]
        for t, older in reversed(list(self._samples)[:-1]):
            if end - t >= min_s and _prompts(totals) - _prompts(older) >= self.min_prompts:
                start, before = t, older
                break
        zero = Sent()
        return Window(end - start, {
            key: Sent(now.prompts - before.get(key, zero).prompts,
                      now.tokens - before.get(key, zero).tokens)
            for key, now in totals.items()})


def _prompts(totals: Mapping[str, Sent]) -> int:
    return sum(s.prompts for s in totals.values())
