"""Whether a decode worker's steps ran beside a computing prefill worker or alone.

Workers on one machine share its memory bandwidth and last-level cache (on a cloud VM perhaps
also the physical cores behind its vCPUs), and a decode step, which reads every weight and
every stream's KV, is what a neighbour's prefill slows most. A run's steps show it: a decode
worker's decode steps are placed *beside* when another worker of the run was mid-step at their
start and *alone* when no other worker's step overlaps them at all (steps that a neighbour
started into are neither), and step_check.py gives the median of measured / priced on each
side. On 2 vCPUs (one prefill and one decode worker of SmolLM2, a core each) the decode
worker's steps ran 1.08x their price beside and 0.95x alone in the run the prices were fitted
on, and beside / alone was 1.09-1.41 in every other run (docs/benchmarks.md).

Informational: the simulator prices a step the same beside or alone. A factor on the decode
worker's steps beside a busy prefill worker, fitted from the split, was tried (on the
decode-only steps; on the mixed ones too, with their prompt part's cost, fitted on the prefill
worker's steps, taken as beside), and left the held-out runs' figures as they were or worse:
their steps alone ran 0.89-1.21x their price, and that drift of the machine between runs,
which the split does not touch, is what their misses follow.

Workers are told by their names ("decode-0", "disagg/decode-0": `pdserve bench compare` names
each worker by its role when the run began); steps are on one wall clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

MIN_STEPS = 20  # steps beside and alone, each, for the split to be shown


class Timed(Protocol):
    @property
    def start_s(self) -> float: ...

    @property
    def end_s(self) -> float: ...


class Placed(NamedTuple):
    """`beside`: a neighbour was mid-step at the step's start; `alone`: no neighbour step
    overlaps it (neither: a neighbour started during it)."""

    beside: bool
    alone: bool


def is_decode_worker(name: str) -> bool:
    """A worker named by role as a decode worker ("decode-0", or "disagg/decode-0")."""
    return name.rsplit("/", 1)[-1].startswith("decode-")


def place(steps: Mapping[str, Sequence[Timed]]) -> dict[str, list[Placed]]:
    """For every decode worker, each of its steps (in the given order) placed against the
    other workers' steps."""
    out = {}
    for name, rows in steps.items():
        if not is_decode_worker(name):
            continue
        others = sorted((s.start_s, s.end_s) for other, its in steps.items() if other != name
                        for s in its if s.end_s > s.start_s)
        longest = max((b - a for a, b in others), default=0.0)
        out[name] = [_place(s, others, longest) for s in rows]
    return out


def _place(step: Timed, others: Sequence[tuple[float, float]], longest: float) -> Placed:
    """`others` sorted by start, none longer than `longest`: only those that started in
    [start - longest, end) can overlap `step`."""
    first = bisect.bisect_left(others, (step.start_s - longest,))
    last = bisect.bisect_left(others, (step.end_s,))
    reaching = [(a, b) for a, b in others[first:last] if b > step.start_s]
    return Placed(any(a <= step.start_s for a, _ in reaching), not reaching)
