"""The measured run's own speed, window by window: a diagnostic, not a prediction.

A machine whose speed moves within a run (on a 2-vCPU AMX Xeon, tile loads change cost
several-fold in bursts of about a second) defeats any price fixed for a whole run, the speed
reference's included: the simulator's misses there mix two things, a model of the scheduling
that is wrong and a machine that ran at another speed at that moment. `--speed-reference
steps` takes the second out, by reading what the run being predicted measured: its own steps
(the .steps.json beside its results), each priced by the calibration from its counts
(`CalibrationProfile.counted_step_seconds`) and timed as step_check.py times them, give per
window of WINDOW_S seconds from the run's start and per kind of step (prompt: computes prompt
tokens, with or without decodes; decode: decode tokens only)

    g(kind, w) = sum of measured seconds / sum of priced seconds, over the kind's steps
                 that started in window w

and every simulated step of that kind starting in window w costs its price times g(kind, w).
A window without a step of the kind takes the kind's ratio over the whole run; a kind the run
never stepped, 1. Times from the run's start: the steps' wall clock less the run's first send
(`run_window`), the trace's time 0; the simulated warm-up, before time 0, takes window 0.

What it tells: figures that land within their tolerance once priced this way are missed by
the machine, not by the model of queues, batching and routing; figures still out are the
model's. It is not a held-out check: the speed comes from the run itself.

Invariants: every factor is finite and > 0; the timeline never changes once built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.planner.simulate.calibration import CalibrationProfile, Chunk, StepCosts
from pdserve.planner.simulate.step_check import priced_seconds, timed_seconds
from pdserve.planner.simulate.step_fit import Step

WINDOW_S = 2.0
KINDS = ("prompt", "decode")


@dataclass(frozen=True)
class SpeedTimeline:
    """g(kind, w) by window (module docstring): `prompt[w]`, `decode[w]` for w < windows; past
    the last window, the kind's whole-run ratio."""

    window_s: float
    prompt: tuple[float, ...]
    decode: tuple[float, ...]
    prompt_run: float  # the whole run's ratio of each kind
    decode_run: float

    def factor(self, t: float, prompt: bool) -> float:
        """g at `t` seconds from the run's start for a step that computes prompt tokens or
        not; t < 0 (the warm-up, -inf before the trace's start is known) takes window 0."""
        factors = self.prompt if prompt else self.decode
        w = math.floor(t / self.window_s) if t > 0 else 0
        if w < len(factors):
            return factors[w]
        return self.prompt_run if prompt else self.decode_run

    def spread(self) -> tuple[float, float]:
        """The smallest and largest factor of the timeline."""
        every = (*self.prompt, *self.decode)
        return min(every), max(every)


def check_window(window_s: float) -> None:
    """ValueError unless `window_s` is a finite number of seconds > 0."""
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"the speed window must be > 0 seconds, got {window_s!r}")


def build_timeline(profile: CalibrationProfile, steps: Mapping[str, Sequence[Step]],
                   origin_s: float, window_s: float = WINDOW_S) -> SpeedTimeline:
    """The timeline of the run whose workers stepped `steps` (wall clock), started at
    `origin_s`. ValueError where no step computed anything."""
    check_window(window_s)
    sums: dict[tuple[str, int], list[float]] = {}  # (kind, window) -> [measured, priced]
    for rows in steps.values():
        ordered = sorted(rows, key=lambda s: (s.start_s, s.end_s))
        for i, s in enumerate(ordered):
            measured = timed_seconds(ordered, i)
            if measured is None or s.start_s < origin_s:
                continue
            price = priced_seconds(profile, s)
            if price <= 0:
                continue
            kind = "prompt" if s.prefill_tokens else "decode"
            cell = sums.setdefault((kind, math.floor((s.start_s - origin_s) / window_s)),
                                   [0.0, 0.0])
            cell[0] += measured
            cell[1] += price
    if not sums:
        raise ValueError("the measured run's steps hold no step that computed anything: "
                         "there is no speed to read from them")
    windows = 1 + max(w for _, w in sums)
    runs = {k: _ratio([c for (kind, _), c in sums.items() if kind == k]) for k in KINDS}
    by_kind = {k: tuple(_ratio([sums[k, w]]) if (k, w) in sums else runs[k]
                        for w in range(windows)) for k in KINDS}
    return SpeedTimeline(window_s, by_kind["prompt"], by_kind["decode"], runs["prompt"],
                         runs["decode"])


def _ratio(cells: Sequence[list[float]]) -> float:
    """Sum of measured over sum of priced; 1 for no cells."""
    priced = sum(c[1] for c in cells)
    return sum(c[0] for c in cells) / priced if priced > 0 else 1.0


class TimedCosts:
    """`costs` priced at the timeline's factor for the simulated time `clock()` (seconds from
    the run's start) when a step starts."""

    def __init__(self, costs: StepCosts, timeline: SpeedTimeline,
                 clock: Callable[[], float]) -> None:
        self.costs, self.timeline, self.clock = costs, timeline, clock

    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        prompt = any(c.tokens for c in chunks)
        return self.costs.step_seconds(chunks, decodes, context_sum) * \
            self.timeline.factor(self.clock(), prompt)
