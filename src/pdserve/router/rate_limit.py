"""Token buckets, one per client identity (an API key's digest, or a client address).

A bucket holds up to `burst` tokens and gains `rate` a second; a request takes one or is
refused with the seconds until one is there. A bucket left alone for `burst / rate` seconds
is full again, which is what a new bucket is: so buckets are kept in least-recently-used order
and those idle that long are forgotten (at most `max_buckets` are kept; past that the least
recently used goes first, which gives that identity a fresh burst early). Memory is bounded by
the identities seen within the last `burst / rate` seconds, and by `max_buckets`.

Lifetime: one per router process; not thread-safe (the event loop's only).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

DEFAULT_MAX_BUCKETS = 100_000


@dataclass(frozen=True)
class RateLimit:
    rate: float  # tokens (requests) a second
    burst: int  # bucket size

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"--rate-limit must be a positive number of requests per second, "
                             f"not {self.rate}")
        if self.burst < 1:
            raise ValueError(f"--rate-burst must be at least 1 request, not {self.burst}")

    @classmethod
    def of(cls, rate: float, burst: int | None) -> RateLimit:
        """`burst` defaults to one second's worth of requests (at least 1)."""
        return cls(rate, max(1, math.ceil(rate)) if burst is None else burst)


class TokenBuckets:
    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic,
                 max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if max_buckets < 1:
            raise ValueError("max_buckets must be >= 1")
        self.limit, self.clock, self.max_buckets = limit, clock, max_buckets
        self._refill_s = limit.burst / limit.rate  # from empty to full
        # identity -> (tokens, time of last update); least recently used first
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, identity: Hashable) -> float:
        """0.0 when `identity` may send a request now (one token taken), else the seconds
        until its next token."""
        now = self.clock()
        tokens, last = self._buckets.pop(identity, (float(self.limit.burst), now))
        tokens = min(float(self.limit.burst), tokens + (now - last) * self.limit.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.limit.rate
        self._buckets[identity] = (tokens, now)
        self._forget_idle(now)
        return wait

    def _forget_idle(self, now: float) -> None:
        buckets = self._buckets
        while len(buckets) > self.max_buckets:
            buckets.popitem(last=False)
        while buckets:
            _, last = next(iter(buckets.values()))
            if now - last < self._refill_s:
                return
            buckets.popitem(last=False)


def retry_after(wait_s: float) -> int:
    """The `Retry-After` header's whole seconds for a wait: rounded up, at least 1."""
    return max(1, math.ceil(wait_s))
