"""Fitting calibration.py's linear step costs to the engine steps pdserve workers record.

Input (workers/step_trace.py; `pdserve bench compare --out cmp.json` writes cmp.steps.json):
worker name -> steps, each [start_s, end_s, prefill_tokens, decode_tokens, num_requests,
decode_context, prefill_attention] with wall-clock seconds; decode_context is the summed context
of the step's decode requests (prompt + output so far, the new token included: the engine's
StepStats), the `context_sum` the simulator prices; prefill_attention the step's prompt
(query, key) pairs. Traces recorded before those existed have the first 5 or 6 fields only:
their contexts (attention) are unknown. A compare file nests workers under configuration names
(`is_steps_file`).

What fits what:
- decode-only steps (prefill_tokens == 0 < decode_tokens) fit decode step(B, C) = overhead +
  per_seq x B + per_context_token x C, B = decode_tokens (one new token per running sequence),
  C = decode_context (see "Decode fit" below);
- pure prefill steps (decode_tokens == 0 < prefill_tokens) fit prefill step(N, A) = overhead +
  per_token x N + per_attention_pair x A, N = prefill_tokens (the tokens computed: prefix-cache
  hits are not), A = prefill_attention (see "Prefill fit" below);
- mixed steps (both > 0, collocated serving) are left out: the model prices them as
  max(prefill overhead, decode overhead) + per_token x N + per_attention_pair x A + per_seq x B
  + per_context_token x C,
  so one mixed time mixes five unknowns through a max, and pure steps measure each side cleanly.
  Exception: with fewer pure prefill steps than mixed ones (a busy collocated worker almost
  always has decodes beside a new prompt; chunked prefill shares every step), the mixed steps
  join the fit once the decode costs are known: t - per_seq x B - per_context_token x C =
  overhead' + per_token x N + per_attention_pair x A, where overhead' stands for
  max(prefill overhead, decode overhead),
  the overhead a mixed step pays.
- steps with no tokens or no measurable length (end_s == start_s) are skipped.

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
(decode by B and, when contexts are known, by quarter octave of C; prefill by quarter octave of
N; a quarter octave of x is round(4 log2 x), i.e. values within about 19% of each other), and
each group gives one point (median of every coordinate, median t) counted as its number of steps
(weight count / t^2, relative error). One slow step moves nothing unless it is its group's
majority. On steps that lie exactly on the model, t is, within a group, an increasing affine
function of the one coordinate that varies there (N; or C at fixed B), so median t = the model
at the medians (also for an even count: the mean of the two middle ones) and the fit is exact.
Why groups of (B, C bin) rather than one point per B: within a run B and C grow together (C is
about B x the mean context), so points of one per-B median C would be nearly collinear in (B, C)
and could not tell per_seq from per_context_token; splitting each B by context keeps the spread
of contexts at equal B, which is what separates the two, while every point stays a median.
A long request's context grows by one token a step, so it stays in a bin for ~19% of its context
in steps: groups stay populated. fit_rows counts the steps used; max_rel_error is the largest
relative error of the group points; median_rel_error the median relative error of the single
steps (outliers included): how far the model typically is from one step.

Decode fit: (overhead, per_seq, per_context_token) by nnls.py on points (B, C), every
coefficient >= 0 and overhead + per_seq > 0 (a decode step takes time; calibration.
CalibrationProfile's invariants), supports preferred in the order of DECODE_SUPPORTS, so:
- contexts that do not vary apart from B (C a multiple of B: singular with all three, (a, b)
  and (a, c) fit equally) give c = 0, the 2-parameter fit in which per_seq absorbs the
  contexts' attention (the old behaviour); a negative unconstrained c is never kept (the
  optimum is then on a face, usually (a, b): c = 0);
- a single B takes the rest as overhead, like calibration.fit_line's decode side.
Decode knee (context cost held): a decode step's linear layers read every weight once while
the batch is small (on a CPU, while its rows fit the kernel's block of rows: avx2_linear.cpp
takes 6), and past some batch each stream adds compute as well (on a GPU the same turn from
memory- to compute-bound comes at a larger batch). One line through both regimes prices small
batches too high and large ones too low, so a calibration run of mostly small batches
underprices a held-out run of large ones. So the held fit also tries a knee K at each measured
batch size with at least two measured batch sizes at or below it and two above:

    step(B, C) = overhead + per_seq x B + per_seq_past_knee x max(0, B - K) + per_context x C

(nnls.py with y = max(0, B - K), per_seq_past_knee > 0), and keeps the knee of least weighted
error when it cuts the line's by at least KNEE_MIN_GAIN: steps on a line keep the line. The
fitted (not held) context cost keeps the line: nnls.py solves three terms at most.
Prefill fit: (overhead, per_token, per_attention_pair) by calibration.fit_prefill on points
(N, A), per_token > 0 (a single N takes it all as per-token cost).
A = the step's (query, key) pairs of prompt tokens (7th field): causal attention over the
prompt and the context before the chunk grows with both, so a 2,000-token prompt costs more per
token than a 200-token one, and a chunk late in a prompt more than the first. Prefill groups
are by quarter octave of N and of A / N (the mean context a prompt token attends to). Traces
without it (5 or 6 fields) fit overhead + per_token x N (calibration.fit_line), attention 0.
Contexts unknown (any decode step of 5 fields): c = 0 and calibration.fit_line on one point per
B, as before decode_context was recorded; the fitted per_seq is then per_seq +
per_context_token x (mean context per sequence of the measured run), right only for runs whose
contexts are like the measured one's.
Limit: the model prices attention by the summed context (paged attention, as the simulator's
context_sum). pdserve's runner pads each decode group to its longest context
(engine/runner.py `_decode_groups`: a group's contexts are within 2x of each other beyond 256
tokens), so the summed context is right to within that factor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pdserve.planner.simulate import nnls
from pdserve.planner.simulate.calibration import (
    BenchPoint,
    CalibrationProfile,
    fit_line,
    fit_prefill,
    streams_seconds,
)
from pdserve.planner.simulate.file_spec import FileSpec, pick_config, refuse_config
from pdserve.planner.simulate.nnls import Point

DECODE_TIMES = ("period", "duration")
STEP_FIELDS = ("[start_s, end_s, prefill_tokens, decode_tokens, num_requests, decode_context, "
               "prefill_attention]")
# Supports (indices into (overhead, per x, per y)), preferred first on equal error (module
# docstring "Decode fit" and "Prefill fit").
DECODE_SUPPORTS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,))
MIN_FIELDS = 5
KNEE_MIN_GAIN = 0.2  # a knee is kept when it cuts the line's weighted error by a fifth


class DecodeTerms(NamedTuple):
    """A decode fit: step(B, C) = overhead + per_seq x B + past_knee x max(0, B - knee) +
    per_context x C (knee 0, past_knee 0: the line)."""

    overhead: float
    per_seq: float
    per_context: float
    knee: int = 0
    past_knee: float = 0.0

    def streams(self, b: float) -> float:
        """The part of a step that grows with its b decode streams (their contexts aside)."""
        return streams_seconds(self.per_seq, self.knee, self.past_knee, b)

    def step(self, b: float, context: float) -> float:
        return self.overhead + self.streams(b) + self.per_context * context


class Step(NamedTuple):
    """One engine step of one worker (workers/step_trace.py's Step); decode_context and
    prefill_attention are None in older traces, which predate them."""

    start_s: float
    end_s: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int
    decode_context: int | None = None
    prefill_attention: int | None = None


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
    """Steps from JSON rows of 7 fields (or 5 or 6: contexts unknown); ValueError naming the
    worker and step (1-based)."""
    return [_step(row, f"{where} step {i}") for i, row in enumerate(rows, start=1)]


def _step(row: Any, where: str) -> Step:
    if not isinstance(row, list) or not MIN_FIELDS <= len(row) <= len(Step._fields):
        raise ValueError(f"{where}: expected {STEP_FIELDS} (decode_context and "
                         f"prefill_attention optional), got {str(row)[:80]}")
    start, end, *counts = row
    for name, value in (("start_s", start), ("end_s", end)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    for name, value in zip(Step._fields[2:], counts, strict=False):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {value!r}")
    if end < start:
        raise ValueError(f"{where}: end_s {end!r} is before start_s {start!r}")
    step = Step(start, end, *counts)
    _check_context(step, where)
    _check_attention(step, where)
    return step


def _check_context(s: Step, where: str) -> None:
    """A decode token attends at least to itself: decode_tokens <= decode_context, and a step
    without decode tokens has no decode context."""
    if s.decode_context is None:
        return
    if s.decode_tokens == 0 and s.decode_context:
        raise ValueError(f"{where}: decode_context must be 0 in a step without decode tokens, "
                         f"got {s.decode_context!r}")
    if s.decode_context < s.decode_tokens:
        raise ValueError(f"{where}: decode_context {s.decode_context!r} is below decode_tokens "
                         f"{s.decode_tokens!r} (each decode token attends at least to itself)")


def _check_attention(s: Step, where: str) -> None:
    """A prompt token attends at least to itself: prefill_tokens <= prefill_attention, and a
    step without prompt tokens has none."""
    a = s.prefill_attention
    if a is not None and (a < s.prefill_tokens or (a and not s.prefill_tokens)):
        raise ValueError(f"{where}: prefill_attention {a!r} must be 0 without prompt tokens and "
                         f"at least prefill_tokens {s.prefill_tokens!r} with them")


class _Groups(NamedTuple):
    decode: dict[tuple[int, int], list[tuple[float, float, float]]]  # (B, C bin) -> (B, C, s)
    prefill: dict[tuple[int, int], list[tuple[float, float, float]]]  # (N, A/N bins) -> (N, A, s)
    mixed: list[Step]
    contexts_known: bool  # every decode-only step has a decode_context
    attention_known: bool  # every step with prompt tokens has a prefill_attention


def _bin(x: float) -> int:
    """Quarter octave of x >= 1: round(4 log2 x)."""
    return round(4 * math.log2(x))


def _prefill_key(tokens: float, attention: float) -> tuple[int, int]:
    return _bin(tokens), _bin(attention / tokens) if attention else 0


def _group(steps: Mapping[str, Sequence[Step]], decode_time: str) -> _Groups:
    decode: list[tuple[int, int | None, float]] = []
    prefill: list[tuple[int, int | None, float]] = []
    mixed: list[Step] = []
    for rows in steps.values():
        ordered = sorted(rows, key=lambda s: (s.start_s, s.end_s))  # None contexts do not compare
        for i, s in enumerate(ordered):
            seconds = s.end_s - s.start_s
            if seconds <= 0 or s.prefill_tokens + s.decode_tokens == 0:
                continue
            if s.prefill_tokens == 0:
                if decode_time == "period" and i + 1 < len(ordered):
                    seconds = max(seconds, ordered[i + 1].start_s - s.start_s)
                decode.append((s.decode_tokens, s.decode_context, seconds))
            elif s.decode_tokens == 0:
                prefill.append((s.prefill_tokens, s.prefill_attention, seconds))
            else:
                mixed.append(s)
    contexts = all(c is not None for _, c, _ in decode)
    attention = all(a is not None for _, a, _ in prefill) and all(
        s.prefill_attention is not None for s in mixed)
    groups = _Groups({}, {}, mixed, contexts, attention)
    for b, c, seconds in decode:
        context = c if contexts and c is not None else 0
        groups.decode.setdefault((b, _bin(context) if context else 0), []).append(
            (b, context, seconds))
    for n, a, seconds in prefill:
        pairs = a if attention and a is not None else 0
        groups.prefill.setdefault(_prefill_key(n, pairs), []).append((n, pairs, seconds))
    return groups


def _points(groups: Mapping[Any, list[tuple[float, float, float]]]) -> list[Point]:
    """One point per group: the medians of x, of y and of t, counted as its steps."""
    points = []
    for key in sorted(groups):
        xs, ys, ts = zip(*groups[key], strict=True)
        points.append(Point(statistics.median(xs), statistics.median(ys), statistics.median(ts),
                            len(ts)))
    return points


def _fit_decode(points: Sequence[Point], contexts_known: bool) -> DecodeTerms:
    """(overhead, per_seq, per_context_token) >= 0 by the module docstring's "Decode fit";
    without contexts, calibration.fit_line on (B, t) and per_context_token 0."""
    if not contexts_known:
        d0, d1 = fit_line([BenchPoint(p.x, p.seconds, p.seconds, p.count) for p in points],
                          single="intercept")
        return DecodeTerms(d0, d1, 0.0)
    coef = nnls.fit(points, DECODE_SUPPORTS, lambda c: c[0] + c[1] > 0)
    if coef is None:  # unreachable: (a) alone is m = sum w > 0, x = sum w t / sum w > 0
        raise ValueError("no decode fit with non-negative coefficients")
    return DecodeTerms(*coef)


def _fit_prefill(points: Sequence[Point], attention_known: bool, source: str
                 ) -> nnls.Coefficients:
    """(overhead, per_token, per_attention_pair) by the module docstring's "Prefill fit"."""
    if attention_known:
        coef = fit_prefill(points)
    else:
        p0, p1 = fit_line([BenchPoint(p.x, p.seconds, p.seconds, p.count) for p in points],
                          single="slope")
        coef = (p0, p1, 0.0) if p1 > 0 else None
    if coef is None:
        raise ValueError(f"{source}: prefill step times do not grow with their tokens, so no "
                         "per-token cost can be fitted (too few or too noisy prefill steps)")
    return coef


def _mixed_as_prefill(mixed: Sequence[Step], decode: DecodeTerms, attention_known: bool
                      ) -> dict[tuple[int, int], list]:
    """Mixed steps less their decode part (the streams' and contexts' terms, C = 0 when
    unknown), grouped like pure prefill steps."""
    groups: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for s in mixed:
        rest = (s.end_s - s.start_s - decode.streams(s.decode_tokens)
                - decode.per_context * (s.decode_context or 0))
        pairs = (s.prefill_attention or 0) if attention_known else 0
        if rest > 0:
            groups.setdefault(_prefill_key(s.prefill_tokens, pairs), []).append(
                (s.prefill_tokens, pairs, rest))
    return groups


def _prefill_groups(groups: _Groups, decode: DecodeTerms) -> dict[tuple[int, int], list]:
    """Pure prefill steps, joined by the mixed ones (less their decode part) when the pure
    ones are fewer: a busy collocated worker has a stray pure step or two (a 1-token prompt
    tail), which alone would price every prompt token like a whole step."""
    pure = groups.prefill
    if sum(map(len, pure.values())) >= len(groups.mixed):
        return pure
    merged = {k: list(v) for k, v in _mixed_as_prefill(
        groups.mixed, decode, groups.attention_known).items()}
    for k, v in pure.items():
        merged.setdefault(k, []).extend(v)
    return merged


def _median_step_error(decode: Mapping[Any, list[tuple[float, float, float]]],
                       decode_terms: DecodeTerms,
                       prefill: Mapping[Any, list[tuple[float, float, float]]],
                       prefill_coef: nnls.Coefficients) -> float:
    """The median |model - t| / t over every step fitted (not its group's medians): how far
    one step typically is from the model, outliers included."""
    errors = [abs(decode_terms.step(b, c) - t) / t
              for rows in decode.values() for b, c, t in rows]
    errors += [abs(nnls.predict(Point(n, a, t, 1), prefill_coef) - t) / t
               for rows in prefill.values() for n, a, t in rows]
    return statistics.median(errors)


def _fit_decode_held(points: Sequence[Point], per_context_s: float, source: str
                     ) -> DecodeTerms:
    """(overhead, per_seq) >= 0, and a knee where one pays (`_knee`), with per_context_token
    held at `per_context_s`: each point's t less per_context_s x C, still weighted by its own t
    (count / t^2, relative error: the count is scaled by (rest / t)^2 since nnls weighs
    count / rest^2)."""
    rest = []
    for p in points:
        left = p.seconds - per_context_s * p.y
        if left <= 0:
            raise ValueError(f"{source}: a decode context cost of {per_context_s * 1e6:g} us per "
                             f"token prices steps of {p.x:g} streams over {p.y:g} context "
                             f"tokens above their measured {p.seconds * 1e3:.1f} ms; hold a "
                             "smaller one")
        rest.append(Point(p.x, 0.0, left, p.count * (left / p.seconds) ** 2))
    coef = nnls.fit(rest, ((0, 1), (0,), (1,)), lambda c: c[0] + c[1] > 0)
    if coef is None:  # unreachable: (a) alone is a weighted mean of positive rests
        raise ValueError(f"{source}: no decode fit with non-negative coefficients")
    bent = _knee(rest, coef)
    if bent is None:
        return DecodeTerms(coef[0], coef[1], per_context_s)
    knee, (d0, d1, dk) = bent
    return DecodeTerms(d0, d1, per_context_s, knee, dk)


def _knee(rest: Sequence[Point], line: nnls.Coefficients
          ) -> tuple[int, nnls.Coefficients] | None:
    """The module docstring's "Decode knee" on points (B, 0, t less the context term): (K,
    (overhead, per_seq, per_seq_past_knee)), or None when no knee cuts the line's weighted
    error by KNEE_MIN_GAIN."""
    bound = (1 - KNEE_MIN_GAIN) * nnls.weighted_error(rest, line)
    batches = sorted({p.x for p in rest})
    best: tuple[float, int, nnls.Coefficients] | None = None
    for knee in batches[1:-2]:  # two batch sizes at or below it, two above
        bent = [p._replace(y=max(0.0, p.x - knee)) for p in rest]
        coef = nnls.fit(bent, ((0, 1, 2), (0, 2)), lambda c: c[0] + c[1] > 0 and c[2] > 0)
        if coef is None:
            continue
        error = nnls.weighted_error(bent, coef)
        if error < bound and (best is None or error < best[0]):
            best = error, int(knee), coef
    return None if best is None else (best[1], best[2])


def fit_step_traces(steps: Mapping[str, Sequence[Step]], decode_time: str = "period",
                    source: str = "step traces", context_token_s: float | None = None
                    ) -> CalibrationProfile:
    """A profile fitted to worker steps (module docstring); `context_token_s` holds the decode
    cost per context token at that value (measured apart: a calibration run whose long
    contexts all come in large batches cannot tell it from the per-stream cost) and fits the
    other two. ValueError when a side has no step to fit, the prefill times do not grow with
    the tokens, or a held context cost needs contexts the steps do not record."""
    if decode_time not in DECODE_TIMES:
        raise ValueError(f"decode_time (--step-time) must be one of {', '.join(DECODE_TIMES)}, "
                         f"got {decode_time!r}")
    groups = _group(steps, decode_time)
    decode = _points(groups.decode)
    if not decode:
        raise ValueError(f"{source}: no decode-only step (prefill_tokens 0, decode_tokens > 0) "
                         "to fit the decode costs")
    if context_token_s is None:
        d = _fit_decode(decode, groups.contexts_known)
    elif groups.contexts_known:
        d = _fit_decode_held(decode, context_token_s, source)
    else:
        raise ValueError(f"{source}: a held decode context cost needs steps that record their "
                         "decode context (6 fields or more)")
    prefill_groups = _prefill_groups(groups, d)
    prefill = _points(prefill_groups)
    if not prefill:
        raise ValueError(f"{source}: no prefill step (prefill_tokens > 0) to fit the prefill "
                         "costs")
    p0, p1, pa = _fit_prefill(prefill, groups.attention_known, source)
    return CalibrationProfile(
        decode_overhead_s=d.overhead, decode_per_seq_s=d.per_seq,
        decode_per_context_token_s=d.per_context, decode_knee_batch=d.knee,
        decode_per_seq_past_knee_s=d.past_knee,
        prefill_overhead_s=p0, prefill_per_token_s=p1, prefill_per_attention_pair_s=pa,
        source=source, fit_rows=int(sum(p.count for p in decode) + sum(p.count for p in prefill)),
        max_rel_error=max(nnls.max_rel_error(decode, lambda p: d.step(p.x, p.y)),
                          nnls.max_rel_error(prefill, lambda p: nnls.predict(p, (p0, p1, pa)))),
        median_rel_error=_median_step_error(groups.decode, d, prefill_groups, (p0, p1, pa)))
