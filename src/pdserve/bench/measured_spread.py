"""When a measured figure is noise: the same measurement taken twice moved by more than the
figure's tolerance, so no simulation can be held to it within that tolerance.

The rule is one for both places that see a figure measured more than once: `bench
simulator-repeat` (two `bench simulator` runs, A then B) and `bench simulator --repeats N`
(N interleaved rounds of every configuration in one run, `bench compare --repeats`: the
results keep every round's figures under `repeats`, in run order). A change is taken from the
earlier measurement, (later - earlier) / earlier; the figures are apart when some pair of
them, earlier and later, changed by more than the tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def change(earlier: float, later: float) -> float:
    """(later - earlier) / earlier; `earlier` > 0."""
    return (later - earlier) / earlier


def apart(values: Sequence[float], tolerance: float) -> bool:
    """Some earlier value (> 0) and a later one changed by more than `tolerance`."""
    return any(abs(change(a, b)) > tolerance
               for i, a in enumerate(values) if a > 0 for b in values[i + 1:])


def rounds(result: dict[str, Any], figure: str) -> list[float]:
    """A `bench compare` configuration's `figure` in every round, in run order: [] for a run
    of one round, or where a round did not record the figure."""
    runs = result.get("repeats") or []
    values = [run.get(figure) for run in runs]
    if len(values) < 2 or any(not isinstance(v, int | float) or isinstance(v, bool)
                              for v in values):
        return []
    return [float(v) for v in values]
