"""Fitting calibration.py's linear step costs to the engine steps pdserve workers record.

Input (workers/step_trace.py; `pdserve bench compare --out cmp.json` writes cmp.steps.json):
worker name -> steps, each [start_s, end_s, prefill_tokens, decode_tokens, num_requests,
decode_context] with wall-clock seconds; decode_context is the summed context of the step's
decode requests (prompt + output so far, the new token included: the engine's StepStats), the
`context_sum` the simulator prices. Traces recorded before it existed have the first 5 fields
only: their contexts are unknown. A compare file nests workers under configuration names
(`is_steps_file`).

What fits what:
- decode-only steps (prefill_tokens == 0 < decode_tokens) fit decode step(B, C) = overhead +
  per_seq x B + per_context_token x C, B = decode_tokens (one new token per running sequence),
  C = decode_context (see "Decode fit" below);
- pure prefill steps (decode_tokens == 0 < prefill_tokens) fit prefill step(N) = overhead +
  per_token x N, N = prefill_tokens (the tokens computed: prefix-cache hits are not);
- mixed steps (both > 0, collocated serving) are left out: the model prices them as
  max(prefill overhead, decode overhead) + per_token x N + per_seq x B + per_context_token x C,
  so one mixed time mixes five unknowns through a max, and pure steps measure each side cleanly.
  Exception: with fewer pure prefill steps than mixed ones (a busy collocated worker almost
  always has decodes beside a new prompt; chunked prefill shares every step), the mixed steps
  join the fit once the decode costs are known: t - per_seq x B - per_context_token x C =
  overhead' + per_token x N, where overhead' stands for max(prefill overhead, decode overhead),
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
relative error of the group points (not of raw steps, which include the outliers).

Decode fit: minimise sum_i w_i (t_i - a - b B_i - c C_i)^2 (w_i = count_i / t_i^2; a, b, c =
overhead, per_seq, per_context_token) subject to a, b, c >= 0 and a + b > 0 (a decode step
takes time; calibration.CalibrationProfile's invariants). The least squares of a support S (the
coefficients allowed to be non-zero, the others held at 0) solve the normal equations
sum_i w_i f_j(i) f_k(i) x_k = sum_i w_i f_j(i) t_i for j, k in S, f = (1, B, C), written out in
`_normal_equations` and solved by Gauss-Jordan elimination (`_solve`, at most 3 x 3). Every
support that contains a or b is solved; solutions with a negative coefficient or a singular
system are dropped; the one with the least weighted squared error wins. This is the exact
optimum under a, b, c >= 0 (non-negative least squares, when that optimum has a + b > 0): the
objective is convex, so the constrained optimum also minimises it on the subspace of its own
support, and is among the candidates. On equal error (within 1e-9 of sum w t^2, rounding) the
first support of (a, b, c), (a, b), (a, c), (b, c), (a), (b) wins, so:
- contexts that do not vary apart from B (C a multiple of B: singular with all three, (a, b)
  and (a, c) fit equally) give c = 0, the 2-parameter fit in which per_seq absorbs the
  contexts' attention (the old behaviour); a negative unconstrained c is never kept (the
  optimum is then on a face, usually (a, b): c = 0);
- a single B takes the rest as overhead, like calibration.fit_line's decode side.
Contexts unknown (any decode step of 5 fields): c = 0 and calibration.fit_line on one point per
B, as before decode_context was recorded; the fitted per_seq is then per_seq +
per_context_token x (mean context per sequence of the measured run), right only for runs whose
contexts are like the measured one's.
Limit: the model prices attention by the summed context (paged attention, as the simulator's
context_sum). pdserve's runner pads each decode group to its longest context
(engine/runner.py `_decode_groups`: a group's contexts are within 2x of each other beyond 256
tokens), so the summed context is right to within that factor.
Singular: the normal matrix scaled to a unit diagonal (entries M_jk / sqrt(M_jj M_kk), i.e.
correlations of the weighted features about 0) has a pivot below 1e-9 during elimination, i.e.
one feature is a combination of the others to within 1 - R^2 < 1e-9.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pdserve.planner.simulate.calibration import BenchPoint, CalibrationProfile, fit_line
from pdserve.planner.simulate.file_spec import FileSpec, pick_config, refuse_config

DECODE_TIMES = ("period", "duration")
STEP_FIELDS = "[start_s, end_s, prefill_tokens, decode_tokens, num_requests, decode_context]"
# Decode fit supports (indices into (overhead, per_seq, per_context_token)), preferred first on
# equal error (module docstring "Decode fit").
SUPPORTS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,))
SINGULAR_PIVOT = 1e-9  # of the unit-diagonal normal matrix: 1 - R^2 of a feature on the others
TIE = 1e-9  # of sum w t^2: errors closer than this are equal (rounding)


class Step(NamedTuple):
    """One engine step of one worker (workers/step_trace.py's Step); decode_context is None in
    5-field traces, which predate it."""

    start_s: float
    end_s: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int
    decode_context: int | None = None


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
    """Steps from JSON rows of 6 fields (or 5, context unknown); ValueError naming the worker
    and step (1-based)."""
    return [_step(row, f"{where} step {i}") for i, row in enumerate(rows, start=1)]


def _step(row: Any, where: str) -> Step:
    if not isinstance(row, list) or len(row) not in (len(Step._fields) - 1, len(Step._fields)):
        raise ValueError(f"{where}: expected {STEP_FIELDS} (decode_context optional), got "
                         f"{str(row)[:80]}")
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


class DecodePoint(NamedTuple):
    """Decode steps of one group: medians of B, of C (0 when unknown) and of t, and the number
    of steps (its weight count / t^2)."""

    batch: float
    context: float
    seconds: float
    count: int

    def features(self) -> tuple[float, float, float]:
        """f = (1, B, C): what overhead, per_seq and per_context_token multiply."""
        return 1.0, self.batch, self.context


class _Groups(NamedTuple):
    decode: dict[tuple[int, int], list[tuple[float, float, float]]]  # (B, C bin) -> (B, C, s)
    prefill: dict[int, list[tuple[float, float]]]  # bin of N -> (N, seconds)
    mixed: list[Step]
    contexts_known: bool  # every decode-only step has a decode_context


def _bin(x: int) -> int:
    """Quarter octave of x >= 1: round(4 log2 x)."""
    return round(4 * math.log2(x))


def _group(steps: Mapping[str, Sequence[Step]], decode_time: str) -> _Groups:
    decode: list[tuple[int, int | None, float]] = []
    groups = _Groups({}, {}, [], True)
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
                groups.prefill.setdefault(_bin(s.prefill_tokens), []).append(
                    (s.prefill_tokens, seconds))
            else:
                groups.mixed.append(s)
    known = all(c is not None for _, c, _ in decode)
    for b, c, seconds in decode:
        context = c if known and c is not None else 0
        key = (b, _bin(context) if context else 0)
        groups.decode.setdefault(key, []).append((b, context, seconds))
    return groups._replace(contexts_known=known)


def _decode_points(groups: Mapping[tuple[int, int], list[tuple[float, float, float]]]
                   ) -> list[DecodePoint]:
    points = []
    for key in sorted(groups):
        bs, cs, ts = zip(*groups[key], strict=True)
        points.append(DecodePoint(statistics.median(bs), statistics.median(cs),
                                  statistics.median(ts), len(ts)))
    return points


def _median_points(groups: Mapping[int, list[tuple[float, float]]]) -> list[BenchPoint]:
    points = []
    for key in sorted(groups):
        xs, ts = zip(*groups[key], strict=True)
        t = statistics.median(ts)
        points.append(BenchPoint(statistics.median(xs), t, t, len(xs)))
    return points


def _normal_equations(points: Sequence[DecodePoint], support: Sequence[int]
                      ) -> tuple[list[list[float]], list[float]]:
    """M[j][k] = sum_i w_i f_j(i) f_k(i) and v[j] = sum_i w_i f_j(i) t_i for j, k in support,
    f = DecodePoint.features(), w_i = count_i / t_i^2: M x = v is the least-squares optimum."""
    m = [[0.0] * len(support) for _ in support]
    v = [0.0] * len(support)
    for p in points:
        w, f = p.count / p.seconds**2, p.features()
        for j, fj in enumerate(f[i] for i in support):
            v[j] += w * fj * p.seconds
            for k, fk in enumerate(f[i] for i in support):
                m[j][k] += w * fj * fk
    return m, v


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with m x = v for a symmetric positive semi-definite m (normal equations, k <= 3): the
    rows and columns are scaled to a unit diagonal (x_j = y_j / sqrt(m_jj)), then Gauss-Jordan
    elimination; None when a pivot falls below SINGULAR_PIVOT (module docstring)."""
    k = len(v)
    if any(m[j][j] <= 0 for j in range(k)):
        return None
    scale = [1 / math.sqrt(m[j][j]) for j in range(k)]
    a = [[m[j][i] * scale[j] * scale[i] for i in range(k)] + [v[j] * scale[j]] for j in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < SINGULAR_PIVOT:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[j][k] / a[j][j] * scale[j] for j in range(k)]


def _weighted_error(points: Sequence[DecodePoint], coef: Sequence[float]) -> float:
    """sum_i w_i (t_i - f(i) . coef)^2, the objective of the decode fit."""
    return sum(p.count / p.seconds**2 * (p.seconds - _dot(p.features(), coef))**2
               for p in points)


def _dot(f: Sequence[float], coef: Sequence[float]) -> float:
    return sum(x * c for x, c in zip(f, coef, strict=True))


def _fit_decode(points: Sequence[DecodePoint], contexts_known: bool
                ) -> tuple[float, float, float]:
    """(overhead, per_seq, per_context_token) >= 0 by the module docstring's "Decode fit";
    without contexts, calibration.fit_line on (B, t) and per_context_token 0."""
    if not contexts_known:
        d0, d1 = fit_line([BenchPoint(p.batch, p.seconds, p.seconds, p.count) for p in points],
                          single="intercept")
        return d0, d1, 0.0
    tie = TIE * sum(p.count for p in points)  # sum w t^2 = sum count
    best: tuple[float, list[float]] | None = None
    for support in SUPPORTS:
        x = _solve(*_normal_equations(points, support))
        if x is None or min(x) < 0:
            continue
        coef = [0.0, 0.0, 0.0]
        for i, xi in zip(support, x, strict=True):
            coef[i] = xi
        if coef[0] + coef[1] <= 0:
            continue
        error = _weighted_error(points, coef)
        if best is None or error < best[0] - tie:
            best = error, coef
    if best is None:  # unreachable: (a) alone is m = sum w > 0, x = sum w t / sum w > 0
        raise ValueError("no decode fit with non-negative coefficients")
    return best[1][0], best[1][1], best[1][2]


def _mixed_as_prefill(mixed: Sequence[Step], per_seq_s: float, per_context_s: float
                      ) -> dict[int, list]:
    """Mixed steps less their decode part (per_seq x B + per_context_token x C, C = 0 when
    unknown), grouped like pure prefill steps."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for s in mixed:
        rest = (s.end_s - s.start_s - per_seq_s * s.decode_tokens
                - per_context_s * (s.decode_context or 0))
        if rest > 0:
            groups.setdefault(_bin(s.prefill_tokens), []).append((s.prefill_tokens, rest))
    return groups


def _max_rel_error(points: Sequence[BenchPoint], line: tuple[float, float]) -> float:
    return max(abs(line[0] + line[1] * p.x - p.fitted_part) / p.seconds for p in points)


def _decode_max_rel_error(points: Sequence[DecodePoint], coef: Sequence[float]) -> float:
    return max(abs(_dot(p.features(), coef) - p.seconds) / p.seconds for p in points)


def _prefill_groups(groups: _Groups, per_seq_s: float, per_context_s: float
                    ) -> dict[int, list]:
    """Pure prefill steps, joined by the mixed ones (less their decode part) when the pure
    ones are fewer: a busy collocated worker has a stray pure step or two (a 1-token prompt
    tail), which alone would price every prompt token like a whole step."""
    pure = groups.prefill
    if sum(map(len, pure.values())) >= len(groups.mixed):
        return pure
    merged = {k: list(v) for k, v in
              _mixed_as_prefill(groups.mixed, per_seq_s, per_context_s).items()}
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
    decode = _decode_points(groups.decode)
    if not decode:
        raise ValueError(f"{source}: no decode-only step (prefill_tokens 0, decode_tokens > 0) "
                         "to fit the decode costs")
    d0, d1, dc = _fit_decode(decode, groups.contexts_known)
    prefill = _median_points(_prefill_groups(groups, d1, dc))
    if not prefill:
        raise ValueError(f"{source}: no prefill step (prefill_tokens > 0) to fit the prefill "
                         "costs")
    p0, p1 = fit_line(prefill, single="slope")
    if p1 <= 0:
        raise ValueError(f"{source}: prefill step times do not grow with their tokens, so no "
                         "per-token cost can be fitted (too few or too noisy prefill steps)")
    return CalibrationProfile(
        decode_overhead_s=d0, decode_per_seq_s=d1, decode_per_context_token_s=dc,
        prefill_overhead_s=p0, prefill_per_token_s=p1, source=source,
        fit_rows=int(sum(p.count for p in decode) + sum(p.count for p in prefill)),
        max_rel_error=max(_decode_max_rel_error(decode, (d0, d1, dc)),
                          _max_rel_error(prefill, (p0, p1))))
