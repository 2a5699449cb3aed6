"""Token buckets on an injected clock: a burst, then refusals with the wait until the next
token, refill at the rate, one bucket per identity, and idle buckets forgotten."""

from __future__ import annotations

import pytest

from pdserve.router.rate_limit import RateLimit, TokenBuckets, retry_after


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_refusals_with_the_wait_then_refill() -> None:
    clock = Clock()
    buckets = TokenBuckets(RateLimit(rate=2.0, burst=3), clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token every 0.5 s
    clock.now += 0.25
    assert buckets.take("a") == pytest.approx(0.25)  # a refusal takes nothing
    clock.now += 0.25
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(0.5)
    clock.now += 60  # refills up to the burst, no more
    assert [buckets.take("a") for _ in range(4)][-2:] == [0.0, pytest.approx(0.5)]


def test_each_identity_has_its_own_bucket() -> None:
    clock = Clock()
    buckets = TokenBuckets(RateLimit(rate=1.0, burst=1), clock)
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(1.0)
    assert buckets.take("b") == 0.0


def test_a_slow_rate_asks_for_a_long_wait() -> None:
    buckets = TokenBuckets(RateLimit(rate=0.1, burst=1), Clock())
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(10.0)


def test_idle_buckets_are_forgotten_and_memory_is_bounded() -> None:
    clock = Clock()
    buckets = TokenBuckets(RateLimit(rate=10.0, burst=5), clock, max_buckets=100)
    for i in range(50):
        buckets.take(i)
    assert len(buckets) == 50
    clock.now += 0.5  # burst / rate: every bucket is full again, as good as new
    buckets.take("fresh")
    assert len(buckets) == 1
    for i in range(1000):  # more identities at once than max_buckets
        buckets.take(i)
    assert len(buckets) == 100


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert [retry_after(w) for w in (0.001, 0.5, 1.0, 1.01, 9.2)] == [1, 1, 1, 2, 10]


def test_limits_are_validated_and_the_burst_defaults_to_a_seconds_worth() -> None:
    assert RateLimit.of(2.5, None) == RateLimit(2.5, 3)
    assert RateLimit.of(0.2, None) == RateLimit(0.2, 1)
    assert RateLimit.of(5, 20).burst == 20
    for rate in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--rate-limit must be a positive number"):
            RateLimit(rate, 1)
    with pytest.raises(ValueError, match="--rate-burst must be at least 1"):
        RateLimit(1.0, 0)
