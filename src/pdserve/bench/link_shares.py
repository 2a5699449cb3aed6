"""How the senders of one incast burst shared the bottleneck link (pure arithmetic, no I/O).

A sender's share is the part of the bytes delivered up to the moment the first sender ended
its last write (`contended_at`): until then every sender had data queued for the link, so
the split is what the network and the senders' transports gave each, not how much each had
to send. Bytes delivered at a time are read off each sender's (time, bytes acknowledged)
samples, linearly between two samples.

Jain's fairness index of x_1..x_n is (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n
when one sender took everything (Jain, Chiu and Hawe, DEC-TR-301, 1984).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

Samples = Sequence[tuple[float, int]]  # (seconds, bytes), time ascending


def bytes_at(samples: Samples, t: float) -> float:
    """Bytes acknowledged at time `t`: interpolated between the samples around it, the first
    sample's before them and the last one's after them (0.0 for no samples)."""
    if not samples:
        return 0.0
    if t <= samples[0][0]:
        return float(samples[0][1])
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        if t <= t1:
            return float(b1) if t1 == t0 else b0 + (b1 - b0) * (t - t0) / (t1 - t0)
    return float(samples[-1][1])


def contended_at(last_done: Sequence[float]) -> float:
    """The end of the stretch when every sender was sending: the earliest last write's end."""
    return min(last_done)


def shares(delivered: Sequence[float]) -> list[float]:
    """Each sender's part of the bytes (they sum to 1; equal parts when none was delivered)."""
    total = sum(delivered)
    if total <= 0:
        return [1 / len(delivered)] * len(delivered)
    return [d / total for d in delivered]


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index, in [1/n, 1]; 1.0 for no values or all zero."""
    square_sum = sum(v * v for v in values)
    if not values or square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)
