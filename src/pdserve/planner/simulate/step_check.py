"""Fitted step costs against another run's steps: is a miss the costs', or the scheduling's?

When a simulation calibrated on run A misses run B's figures, either A's step costs do not
price B's steps (B batches more streams, longer contexts, ...), or the steps are priced right
and the model of what runs in them (queues, routing, pacing) is wrong. B's own steps (the
.steps.json beside its results) tell which: each recorded step is priced by A's profile from
its counts (`CalibrationProfile.counted_step_seconds`), and its measured time divided by that
price is its ratio (1: priced exactly; 1.2: it took 20% longer than the profile says).

Per kind of step (KINDS: decode-only, prompt-only, both), the median ratio, the time ratio (the
kind's measured seconds over its priced seconds: the few heavy steps that the median passes
over but a saturated worker's queue is made of, e.g. batches larger than the calibration run
ever had) and the kind's share of the run's step time. Times as the fit takes them
(step_fit.py): a decode-only step by its period (to the same worker's next step: what a stream
waits) unless that period holds an idle gap, i.e. is more than twice its duration (then its
duration), the others by their duration. Traces without contexts or attention pairs price those
terms at 0.
A decode worker's decode-only steps also have their median ratio beside a computing prefill
worker and alone (neighbour.py), where the run has enough of each: how much of a miss is the
neighbour's.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.planner.simulate import neighbour
from pdserve.planner.simulate.calibration import CalibrationProfile
from pdserve.planner.simulate.file_spec import (
    FileSpec,
    parse_file_spec,
    parse_json_document,
    read_text,
    steps_path,
)
from pdserve.planner.simulate.step_fit import Step, is_steps_file, select_steps

KINDS = ("decode", "prompt", "mixed")
IDLE_FACTOR = 2.0  # a period over twice its step's duration holds an idle gap


def steps_beside(results_spec: str, flag: str) -> dict[str, list[Step]] | None:
    """The steps of the run RESULTS[:CONFIG] names, from RESULTS' .steps.json beside it (bench
    compare writes X.json and X.steps.json); None when there is none or it lacks CONFIG."""
    spec = parse_file_spec(results_spec, flag)
    path = steps_path(spec.path)
    if not path.is_file():
        return None
    data = parse_json_document(read_text(FileSpec(path, None, flag)))
    if not is_steps_file(data):
        return None
    try:
        return select_steps(data, FileSpec(path, spec.config, flag))
    except ValueError:  # another configuration, or a file of one configuration with :CONFIG
        return None


def kind(step: Step) -> str | None:
    """decode, prompt or mixed; None for a step that computed nothing."""
    if step.prefill_tokens and step.decode_tokens:
        return "mixed"
    return "prompt" if step.prefill_tokens else "decode" if step.decode_tokens else None


def timed_seconds(rows: Sequence[Step], i: int) -> float | None:
    """Step i of one worker's `rows` (in start order) timed as its price is held to (module
    docstring): a decode-only step by its period, unless that holds an idle gap; None for a
    step that computed nothing or has no length."""
    s = rows[i]
    measured = s.end_s - s.start_s
    if kind(s) is None or measured <= 0:
        return None
    if kind(s) == "decode" and i + 1 < len(rows):
        period = rows[i + 1].start_s - s.start_s
        return period if measured <= period <= IDLE_FACTOR * measured else measured
    return measured


def priced_seconds(profile: CalibrationProfile, s: Step) -> float:
    """What `profile` prices the recorded step `s` at, from its counts (contexts and attention
    pairs a trace lacks priced at 0)."""
    return profile.counted_step_seconds(s.prefill_tokens, s.prefill_attention or 0,
                                        s.decode_tokens, s.decode_context or 0)


def step_ratios(profile: CalibrationProfile, steps: Mapping[str, Sequence[Step]]
                ) -> dict[str, dict[str, Any]]:
    """Per kind present: {"steps": n, "median_ratio": r, "time_ratio": t, "share": s} by the
    module docstring, and for decode-only steps of decode workers, where each side has
    neighbour.MIN_STEPS, {"beside": r, "alone": r}: their median ratio beside a computing
    neighbour and alone (neighbour.py)."""
    ratios: dict[str, list[float]] = {k: [] for k in KINDS}
    seconds: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    timed: dict[str, float] = dict.fromkeys(KINDS, 0.0)  # as priced: decode steps by period
    priced: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    sides: dict[str, list[float]] = {"beside": [], "alone": []}
    ordered = {w: sorted(rows, key=lambda s: (s.start_s, s.end_s)) for w, rows in steps.items()}
    placed = neighbour.place(ordered)
    for name, rows in ordered.items():
        for i, s in enumerate(rows):
            k, measured = kind(s), timed_seconds(rows, i)
            if k is None or measured is None:
                continue
            seconds[k] += s.end_s - s.start_s
            price = priced_seconds(profile, s)
            ratios[k].append(measured / price)
            timed[k] += measured
            priced[k] += price
            if k == "decode" and name in placed:
                where = placed[name][i]
                if where.beside or where.alone:
                    sides["beside" if where.beside else "alone"].append(measured / price)
    total = sum(seconds.values())
    out = {k: {"steps": len(ratios[k]), "median_ratio": statistics.median(ratios[k]),
               "time_ratio": timed[k] / priced[k], "share": seconds[k] / total}
           for k in KINDS if ratios[k]}
    if all(len(v) >= neighbour.MIN_STEPS for v in sides.values()):
        out["decode"] |= {side: statistics.median(v) for side, v in sides.items()}
    return out


def describe_ratios(ratios: Mapping[str, Mapping[str, Any]]) -> str:
    """"decode x1.17 (time x1.40, 52% of step time), mixed x1.13 (time x1.20, 48% of step
    time)": measured / priced, per kind (a file written before the time ratio: the median
    only)."""
    return ", ".join(f"{k} x{r['median_ratio']:.2f} ({_time(r)}{r['share']:.0%} of step "
                     f"time{_sides(r)})" for k, r in ratios.items())


def _time(ratio: Mapping[str, Any]) -> str:
    return f"time x{ratio['time_ratio']:.2f}, " if "time_ratio" in ratio else ""


def _sides(ratio: Mapping[str, Any]) -> str:
    """"; a decode worker's steps beside a computing prefill worker x1.37, alone x0.99", or ""
    without the split."""
    if "beside" not in ratio:
        return ""
    return (f"; a decode worker's steps beside a computing prefill worker x{ratio['beside']:.2f}"
            f", alone x{ratio['alone']:.2f}")
