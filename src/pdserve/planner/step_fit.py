"""Fitting calibration.py's linear step costs to the engine steps pdserve workers record.

Input (workers/step_trace.py; `pdserve bench compare --out cmp.json` writes cmp.steps.json):
worker name -> steps, each [start_s, end_s, prefill_tokens, decode_tokens, num_requests] with
wall-clock seconds; a compare file nests that under configuration names (`is_steps_file`).

What fits what:
- decode-only steps (prefill_tokens == 0 < decode_tokens) fit decode step(B) = overhead +
  per_seq x B, B = decode_tokens (one new token per running sequence);
- pure prefill steps (decode_tokens == 0 < prefill_tokens) fit prefill step(N) = overhead +
  per_token x N, N = prefill_tokens (the tokens computed: prefix-cache hits are not);
- mixed steps (both > 0, collocated serving) are left out: the model prices them as
  max(prefill overhead, decode overhead) + per_token x N + per_seq x B, so one mixed time
  mixes four unknowns through a max, and pure steps measure each side cleanly. Exception: with
  fewer pure prefill steps than mixed ones (a busy collocated worker almost always has decodes
  beside a new prompt; chunked prefill shares every step), the mixed steps join the fit once the
  decode line is known: t - per_seq x B = overhead' + per_token x N, where overhead' stands
  for max(prefill overhead, decode overhead), the overhead a mixed step pays.
- steps with no tokens or no measurable length (end_s == start_s) are skipped.

Context: the decode context term stays 0. Steps do not record their sequences' contexts, so
per_context_token cannot be told from per_seq: the fitted per_seq is per_seq + per_context_token
x (mean context per sequence of the measured run), and the profile is right for runs whose
contexts are like the measured one's.

Decode step time (`decode_time`):
- "period" (default): from the step's start to the start of the next step on the same worker
  (end - start for a worker's last step). A streaming client's ITL is that period: it includes
  the worker's own work between engine steps (emitting tokens, taking requests, KV arrivals).
  After a step that finished every running request the worker idles; that long period is
  dropped as an outlier by the medians below.
- "duration": end - start, the engine step alone.
Prefill and mixed steps always use end - start: a prefill worker under light load idles after
most steps, so its periods say nothing.

Robust statistics: a descheduled process makes a few steps far too long. Steps are grouped
(decode by B; prefill by quarter octave of N, round(4 log2 N), i.e. N within about 19% of each
other), and each group gives one point (median x, median t) counted as its number of steps
(calibration.fit_line weights count / t^2). One slow step moves nothing unless it is its group's
majority. On steps that lie exactly on a line t = a + b x (b >= 0), t is an increasing
affine function of x, so median t = a + b (median x) (also for an even count: the mean of the
two middle ones) and the fit is exact. fit_rows counts the steps used; max_rel_error is the
largest relative error of the group points (not of raw steps, which include the outliers).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pdserve.planner.calibration import BenchPoint, CalibrationProfile, fit_line
from pdserve.planner.file_spec import FileSpec, pick_config, refuse_config

DECODE_TIMES = ("period", "duration")
STEP_FIELDS = "[start_s, end_s, prefill_tokens, decode_tokens, num_requests]"


class Step(NamedTuple):
    """One engine step of one worker (workers/step_trace.py's Step)."""

    start_s: float
    end_s: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int


def is_steps_file(data: Any) -> bool:
    """A non-empty object of worker -> list, or of configuration -> {worker -> list}."""
    if not isinstance(data, dict) or not data:
        return False
    values = data.values()
    return all(isinstance(v, list) for v in values) or all(
        isinstance(v, dict) and all(isinstance(w, list) for w in v.values()) for v in values)


def select_steps(data: dict[str, Any], spec: FileSpec) -> dict[str, list[Step]]:
    """Validated steps by worker label: every worker of every configuration, or of
    spec.config only; a file of bare workers (one configuration) takes no :CONFIG."""
    if all(isinstance(v, list) for v in data.values()):
        refuse_config(spec, "one configuration's steps file")
        return {w: parse_steps(rows, f"{spec.path} worker {w!r}") for w, rows in data.items()}
    configs = data if spec.config is None else {spec.config: pick_config(spec, data, "steps file")}
    return {f"{c}/{w}": parse_steps(rows, f"{spec.path} configuration {c!r} worker {w!r}")
            for c, workers in configs.items() for w, rows in workers.items()}


def parse_steps(rows: list[Any], where: str) -> list[Step]:
    """Steps from JSON rows; ValueError naming the worker and step (1-based)."""
    return [_step(row, f"{where} step {i}") for i, row in enumerate(rows, start=1)]


def _step(row: Any, where: str) -> Step:
    if not isinstance(row, list) or len(row) != len(Step._fields):
        raise ValueError(f"{where}: expected {STEP_FIELDS}, got {str(row)[:80]}")
    start, end, *counts = row
    for name, value in (("start_s", start), ("end_s", end)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    for name, value in zip(Step._fields[2:], counts, strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {value!r}")
    if end < start:
        raise ValueError(f"{where}: end_s {end!r} is before start_s {start!r}")
    return Step(start, end, *counts)


class _Groups(NamedTuple):
    decode: dict[int, list[tuple[float, float]]]  # B -> (B, seconds)
    prefill: dict[int, list[tuple[float, float]]]  # bin of N -> (N, seconds)
    mixed: list[Step]


def _prefill_bin(tokens: int) -> int:
    return round(4 * math.log2(tokens))


def _group(steps: Mapping[str, Sequence[Step]], decode_time: str) -> _Groups:
    groups = _Groups({}, {}, [])
    for rows in steps.values():
        ordered = sorted(rows)
        for i, s in enumerate(ordered):
            seconds = s.end_s - s.start_s
            if seconds <= 0 or s.prefill_tokens + s.decode_tokens == 0:
                continue
            if s.prefill_tokens == 0:
                if decode_time == "period" and i + 1 < len(ordered):
                    seconds = max(seconds, ordered[i + 1].start_s - s.start_s)
                groups.decode.setdefault(s.decode_tokens, []).append((s.decode_tokens, seconds))
            elif s.decode_tokens == 0:
                groups.prefill.setdefault(_prefill_bin(s.prefill_tokens), []).append(
                    (s.prefill_tokens, seconds))
            else:
                groups.mixed.append(s)
    return groups


def _median_points(groups: Mapping[int, list[tuple[float, float]]]) -> list[BenchPoint]:
    points = []
    for key in sorted(groups):
        xs, ts = zip(*groups[key], strict=True)
        t = statistics.median(ts)
        points.append(BenchPoint(statistics.median(xs), t, t, len(xs)))
    return points


def _mixed_as_prefill(mixed: Sequence[Step], per_seq_s: float) -> dict[int, list]:
    """Mixed steps less their decode per-seq part, grouped like pure prefill steps."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for s in mixed:
        rest = s.end_s - s.start_s - per_seq_s * s.decode_tokens
        if rest > 0:
            groups.setdefault(_prefill_bin(s.prefill_tokens), []).append((s.prefill_tokens, rest))
    return groups


def _max_rel_error(points: Sequence[BenchPoint], line: tuple[float, float]) -> float:
    return max(abs(line[0] + line[1] * p.x - p.fitted_part) / p.seconds for p in points)


def _prefill_groups(groups: _Groups, per_seq_s: float) -> dict[int, list]:
    """Pure prefill steps, joined by the mixed ones (less their decode part) when the pure
    ones are fewer: a busy collocated worker has a stray pure step or two (a 1-token prompt
    tail), which alone would price every prompt token like a whole step."""
    pure = groups.prefill
    if sum(map(len, pure.values())) >= len(groups.mixed):
        return pure
    merged = {k: list(v) for k, v in _mixed_as_prefill(groups.mixed, per_seq_s).items()}
    for k, v in pure.items():
        merged.setdefault(k, []).extend(v)
    return merged


def fit_step_traces(steps: Mapping[str, Sequence[Step]], decode_time: str = "period",
                    source: str = "step traces") -> CalibrationProfile:
    """A profile fitted to worker steps (module docstring); ValueError when a side has no step
    to fit or the prefill times do not grow with the tokens."""
    if decode_time not in DECODE_TIMES:
        raise ValueError(f"decode_time (--step-time) must be one of {', '.join(DECODE_TIMES)}, "
                         f"got {decode_time!r}")
    groups = _group(steps, decode_time)
    decode = _median_points(groups.decode)
    if not decode:
        raise ValueError(f"{source}: no decode-only step (prefill_tokens 0, decode_tokens > 0) "
                         "to fit the decode costs")
    d0, d1 = fit_line(decode, single="intercept")
    prefill = _median_points(_prefill_groups(groups, d1))
    if not prefill:
        raise ValueError(f"{source}: no prefill step (prefill_tokens > 0) to fit the prefill "
                         "costs")
    p0, p1 = fit_line(prefill, single="slope")
    if p1 <= 0:
        raise ValueError(f"{source}: prefill step times do not grow with their tokens, so no "
                         "per-token cost can be fitted (too few or too noisy prefill steps)")
    return CalibrationProfile(
        decode_overhead_s=d0, decode_per_seq_s=d1, prefill_overhead_s=p0,
        prefill_per_token_s=p1, source=source,
        fit_rows=int(sum(p.count for p in decode + prefill)),
        max_rel_error=max(_max_rel_error(decode, (d0, d1)), _max_rel_error(prefill, (p0, p1))))
