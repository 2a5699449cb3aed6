"""Per-link hand-over estimates: one per (prefill, decode) pair, a fixed term where the sizes
support one, forgetting by count and by time, and the fallback for a pair not measured."""

from __future__ import annotations

import pytest

from pdserve.metrics import Registry
from pdserve.router.link_estimates import (
    HALF_LIFE,
    MEMORY_S,
    MIN_RATE_BYTES,
    SAMPLES,
    LinkEstimate,
    LinkEstimates,
)

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_pair_is_learnt_from_its_own_hand_overs() -> None:
    links = LinkEstimates(Clock())
    links.observe("p0", "d0", 10 * MB, 1.0)  # 10 MB/s
    links.observe("p1", "d0", 10 * MB, 0.01)  # 1 GB/s
    table = links.table()
    assert table.seconds("p0", "d0", 5 * MB) == pytest.approx(0.5)
    assert table.seconds("p1", "d0", 5 * MB) == pytest.approx(0.005)


def test_a_pair_not_measured_counts_at_the_others_mean_else_at_no_cost() -> None:
    links = LinkEstimates(Clock())
    assert links.table().seconds("p0", "d0", 10**9) == 0.0
    links.observe("p0", "d0", 10 * MB, 1.0)
    links.observe("p1", "d0", 10 * MB, 0.2)
    assert links.table().seconds("p2", "d0", 10 * MB) == pytest.approx(0.6)
    assert links.table().seconds("p0", "d1", 10 * MB) == pytest.approx(0.6)


def test_a_fixed_cost_is_fitted_from_small_and_large_hand_overs() -> None:
    link = LinkEstimate(Clock())
    for nbytes in (MB // 10, 4 * MB, MB, 10 * MB):
        link.observe(nbytes, 0.005 + nbytes / 1e8)  # 5 ms + 100 MB/s
    fit = link.fit()
    assert fit is not None and fit.samples == 4
    assert fit.fixed_s == pytest.approx(0.005) and fit.bytes_per_s == pytest.approx(1e8)
    # bytes over seconds alone would make the 100 kB hand-over cost 2.6 ms, not 6 ms
    assert fit.seconds(MB // 10) == pytest.approx(0.006)


def test_small_hand_overs_give_a_fixed_cost_and_no_bandwidth() -> None:
    link = LinkEstimate(Clock())
    link.observe(200_000, 0.5)  # a short prompt's KV: the half second is not its bytes'
    fit = link.fit()
    assert fit is not None and fit.bytes_per_s is None and fit.fixed_s == pytest.approx(0.5)
    # read as 400 kB/s, a 40 MB prompt would cost 100 s on this link
    assert fit.seconds(40 * MB) == pytest.approx(0.5)
    assert "no bandwidth" in str(fit)
    link.observe(100_000, 0.1)  # a slower small one still shows, in the fixed cost
    weights = (0.5 ** 0.25, 1.0)
    assert link.fit().fixed_s == pytest.approx((weights[0] * 0.5 + 0.1) / sum(weights))
    link.observe(MIN_RATE_BYTES, 0.05)  # the first large enough one measures a bandwidth
    fit = link.fit()
    assert fit.bytes_per_s is not None and fit.fixed_s == 0.0
    assert fit.bytes_per_s == pytest.approx(_weighted_ratio(
        [(200_000, 0.5), (100_000, 0.1), (MIN_RATE_BYTES, 0.05)]))


def test_a_link_with_no_bandwidth_reads_0_in_the_gauge_and_its_fixed_cost() -> None:
    links = LinkEstimates(Clock())
    registry = Registry()
    bandwidth = registry.gauge("bw", "", ["prefill", "decode"])
    fixed = registry.gauge("fixed", "", ["prefill", "decode"])
    links.observe("p0", "d0", 20_000, 0.03)
    links.publish(bandwidth, fixed)
    assert bandwidth.value(prefill="p0", decode="d0") == 0.0
    assert fixed.value(prefill="p0", decode="d0") == pytest.approx(0.03)
    assert links.table().seconds("p1", "d0", 40 * MB) == pytest.approx(0.03)  # the mean


def _weighted_ratio(samples: list[tuple[int, float]]) -> float:
    """Bytes over seconds, a sample weighing half as much per HALF_LIFE newer ones."""
    weights = [0.5 ** ((len(samples) - 1 - i) / HALF_LIFE) for i in range(len(samples))]
    return sum(w * b for w, (b, _) in zip(weights, samples, strict=True)) / \
        sum(w * s for w, (_, s) in zip(weights, samples, strict=True))


def test_without_a_spread_of_sizes_the_rate_is_bytes_over_seconds() -> None:
    same = LinkEstimate(Clock())
    samples = [(MB, 0.010), (2 * MB, 0.030), (MB, 0.020)]
    for nbytes, seconds in samples:
        same.observe(nbytes, seconds)
    fit = same.fit()
    assert fit is not None and fit.fixed_s == 0.0
    assert fit.bytes_per_s == pytest.approx(_weighted_ratio(samples))
    falling = LinkEstimate(Clock())  # larger hand-overs faster: no line, the ratio
    samples = [(MB, 0.05), (4 * MB, 0.04), (8 * MB, 0.03)]
    for nbytes, seconds in samples:
        falling.observe(nbytes, seconds)
    fit = falling.fit()
    assert fit is not None and fit.fixed_s == 0.0
    assert fit.bytes_per_s == pytest.approx(_weighted_ratio(samples))


def test_nothing_moved_or_a_nonsense_time_is_no_sample() -> None:
    link = LinkEstimate(Clock())
    assert not link.observe(0, 5.0)
    assert not link.observe(10, float("nan"))
    assert not link.observe(10, 0.0)
    assert link.fit() is None


def test_a_slower_link_is_believed_at_once_and_a_faster_one_within_samples() -> None:
    link, seen = LinkEstimate(Clock()), []

    def observe(nbytes: int, seconds: float) -> None:
        link.observe(nbytes, seconds)
        seen.append((nbytes, seconds))

    for _ in range(SAMPLES):
        observe(MB, 0.001)  # 1 GB/s
    observe(MB, 1.0)  # then 1 MB/s: the slow hand-over's seconds dominate at once
    assert link.fit().bytes_per_s < 20 * MB
    for _ in range(HALF_LIFE):
        observe(MB, 0.001)  # 1 GB/s again: the slow sample weighs half as much
    assert link.fit().bytes_per_s == pytest.approx(_weighted_ratio(seen[-SAMPLES:]))
    for _ in range(SAMPLES - HALF_LIFE):
        observe(MB, 0.001)
    assert link.fit().bytes_per_s == pytest.approx(1e9)  # SAMPLES later it is gone


def test_a_link_not_used_for_memory_s_is_unmeasured_again() -> None:
    clock = Clock()
    links = LinkEstimates(clock)
    links.observe("p0", "d0", MB, 1.0)  # degraded: the router then avoids it
    clock.now += MEMORY_S / 2
    links.observe("p1", "d0", MB, 0.002)
    assert links.table().seconds("p0", "d0", MB) == pytest.approx(1.0)
    clock.now += MEMORY_S / 2 + 0.1
    table = links.table()
    assert set(table.fits) == {("p1", "d0")}
    assert table.seconds("p0", "d0", MB) == pytest.approx(0.002)  # probed again at the mean
    clock.now += MEMORY_S
    assert links.table().seconds("p0", "d0", MB) == 0.0


def test_the_gauges_show_each_link_and_zero_once_forgotten() -> None:
    clock = Clock()
    links = LinkEstimates(clock)
    registry = Registry()
    bandwidth = registry.gauge("bw", "", ["prefill", "decode"])
    fixed = registry.gauge("fixed", "", ["prefill", "decode"])
    links.observe("p0", "d0", 2 * MB, 0.5)
    links.publish(bandwidth, fixed)
    assert bandwidth.value(prefill="p0", decode="d0") == pytest.approx(4 * MB)
    assert fixed.value(prefill="p0", decode="d0") == 0.0
    clock.now += MEMORY_S + 1
    links.observe("p1", "d0", MB, 0.001)
    links.publish(bandwidth, fixed)
    assert bandwidth.value(prefill="p0", decode="d0") == 0.0
    assert bandwidth.value(prefill="p1", decode="d0") == pytest.approx(1e9)
