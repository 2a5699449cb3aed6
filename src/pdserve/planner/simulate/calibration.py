"""Per-step costs for the simulator: the planner's roofline, or a profile fitted to measurements.

A step is what one worker runs at once: prefill `Chunk`s (whole prompts, or slices of them under
chunked prefill) plus `decodes` running requests whose contexts sum to `context_sum` tokens.

`RooflineCosts` (uncalibrated) composes planner/cost.py's pieces into one roofline over the step:
FLOPs = sum over chunks of [2 x active block params x tokens + causal attention of the chunk's
queries over its prefix and itself (prefill_attention_flops(start + tokens) -
prefill_attention_flops(start)) + 2 x LM head params when the chunk ends its prompt]
+ decodes x 2 x (active block params + LM head) + decode_attention_flops(context_sum);
bytes = weight_bytes_read(all tokens of the step) + KV per token x (every chunk's prefix and
itself + context_sum); FLOPs and weight bytes are divided by tp. So a step of one whole prompt
is cost.prefill_time and a step of decodes alone is cost.decode_step_time.

`CalibrationProfile` (calibrated) is a fitted model of one machine running one model, linear
in each term:
  decode step(B, ctx) = decode_overhead_s + decode_per_seq_s x B + decode_per_seq_past_knee_s x
  max(0, B - decode_knee_batch) + decode_per_context_token_s x ctx (ctx = the batch's summed
  context; the knee term is 0 unless step_fit.py found one: see its "Decode knee");
  prefill step(N, A) = prefill_overhead_s + prefill_per_token_s x N +
  prefill_per_attention_pair_s x A (N = prompt tokens in the step;
  A = their (query, key) pairs: a chunk of n tokens after s already computed attends to
  n x s + n (n + 1) / 2, `attention_pairs`); a mixed step pays the larger overhead once plus
  every per-token and per-pair term.

Fitting from `pdserve bench engine --json` rows (`fit_bench_rows`):
- a decode row (batch B, pdserve_tok_s r) measured steps of B / r seconds (one token per
  sequence per step); with the context term c fixed (see below), t_i = B_i / r_i -
  c x B_i x prompt_tokens_i is fitted as overhead + per_seq x B_i.
- a prefill row (batch b, prompt_tokens T of which C cached, r) measured a step of
  b x (T - C) / r seconds over N = b x (T - C) computed tokens and their attention pairs
  A = b x attention_pairs(Chunk(C, T - C)), fitted as overhead + per_token x N +
  per_attention_pair x A by nnls.py (every coefficient >= 0, per_token > 0; the rows' prompt
  lengths, 512 to 8,191 by default, and the half-cached row tell the terms apart).
- each fit (`fit_line`) is weighted least squares on relative error (weights n_i / t_i^2,
  n_i = 1 for a bench row, the number of steps a point stands for in step_fit.py), closed form:
  slope = (S Sxt - Sx St) / (S Sxx - Sx^2), intercept = (St - slope Sx) / S with S = sum w,
  Sx = sum w x, St = sum w t, Sxx = sum w x^2, Sxt = sum w x t. With one distinct x, decode
  takes it all as overhead (a batch-independent step) and prefill all as per-token cost. A
  negative slope becomes 0 (intercept = St / S); a negative intercept becomes 0 (slope =
  Sxt / Sxx). So rows that lie on a line are reproduced exactly.
- c = KV bytes per token per GPU / (memory bandwidth x MBU) of the named model and device
  (the roofline's KV read), 0 when no model is named: bench rows use short contexts and cannot
  measure it. Rows do not record decode steps, so the row context is taken as prompt_tokens.

Fitting the engine steps pdserve workers record (`pdserve bench compare`'s .steps.json) is in
step_fit.py; calibration_source.py tells the `--calibrate` file formats apart.

Profile JSON (schema "pdserve.calibration-profile/1"; a `pdserve bench serve` result can be
converted into it):
  {"schema": "pdserve.calibration-profile/1",   required, exactly this string
   "source": str,                               optional: what was measured, where
   "model": str | null, "gpu": str | null,      optional: preset or config path; device preset
   "tp": int >= 1,                              optional, default 1
   "decode": {"overhead_s": float >= 0, "per_seq_s": float >= 0,
              "per_context_token_s": float >= 0 (optional, default 0),
              "knee_batch": int >= 0 (optional, default 0: no knee),
              "per_seq_past_knee_s": float >= 0 (optional, default 0; 0 without a knee)},
   "prefill": {"overhead_s": float >= 0 (optional, default 0), "per_token_s": float > 0,
               "per_attention_pair_s": float >= 0 (optional, default 0)},
   "fit": {"rows": int, "max_rel_error": float,   optional, informational: steps fitted, the
           "median_rel_error": float}}             largest error of a group's medians, the
                                                   median error of a single step
Invariants: every coefficient is finite and >= 0, a decode step at batch 1 and a prefill token
both take positive time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from pdserve.planner.cost import (
    Efficiency,
    decode_attention_flops,
    prefill_attention_flops,
    weight_bytes_read,
)
from pdserve.planner.hardware import Hardware
from pdserve.planner.kv_math import check_tp
from pdserve.planner.model_shape import ModelShape
from pdserve.planner.simulate import nnls
from pdserve.planner.simulate.nnls import Point

PROFILE_SCHEMA = "pdserve.calibration-profile/1"
# Prefill fit supports (indices into (overhead, per_token, per_attention_pair), nnls.py),
# preferred first on equal error: every one keeps a per-token cost (a prompt token takes time)
PREFILL_SUPPORTS = ((0, 1, 2), (0, 1), (1, 2), (1,))


class Chunk(NamedTuple):
    """Prompt tokens [start, start + tokens) computed in one step; `completes`: the last ones."""

    start: int
    tokens: int
    completes: bool


def attention_pairs(chunk: Chunk) -> int:
    """The (query, key) pairs of a chunk's causal attention: each of its tokens attends to the
    `start` before it and to the chunk up to itself."""
    return chunk.tokens * chunk.start + chunk.tokens * (chunk.tokens + 1) // 2


class StepCosts(Protocol):
    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        """Seconds one worker takes for `chunks` of prefill plus `decodes` decode tokens."""
        ...


@dataclass(frozen=True)
class RooflineCosts:
    """planner/cost.py's roofline over a whole step (module docstring) on one TP group.

    The roofline is cost.roofline's max(FLOPs / (peak x MFU), bytes / (bandwidth x MBU)),
    inlined with per-token constants taken once from cost.py's functions (decode attention is
    linear in context, so decode_attention_flops(shape, 1) scales) and weight bytes cached per
    token count: a simulation asks for millions of steps.
    """

    shape: ModelShape
    hardware: Hardware
    tp: int
    kv_bytes_per_token_rank: int
    efficiency: Efficiency
    linear_flops: float = field(init=False, repr=False)  # per token through the blocks
    logit_flops: float = field(init=False, repr=False)  # per token through the LM head
    attention_flops: float = field(init=False, repr=False)  # per decode context token
    flop_rate: float = field(init=False, repr=False)  # peak x MFU
    byte_rate: float = field(init=False, repr=False)  # bandwidth x MBU
    weight_bytes: dict[int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s, eff = self.shape, self.efficiency
        check_tp(self.tp)
        for name, value in (("linear_flops", 2 * s.body_active_params),
                            ("logit_flops", 2 * s.lm_head_params),
                            ("attention_flops", decode_attention_flops(s, 1)),
                            ("flop_rate", self.hardware.peak_flops(s.weight_dtype) * eff.mfu),
                            ("byte_rate", self.hardware.memory_bandwidth * eff.mbu),
                            ("weight_bytes", {})):
            object.__setattr__(self, name, value)

    def _weights(self, tokens: int) -> float:
        """weight_bytes_read(tokens) / tp, cached."""
        if tokens not in self.weight_bytes:
            self.weight_bytes[tokens] = weight_bytes_read(self.shape, tokens) / self.tp
        return self.weight_bytes[tokens]

    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        flops, tokens, kv_tokens = 0.0, decodes, context_sum
        for c in chunks:
            end = c.start + c.tokens
            flops += self.linear_flops * c.tokens + (self.logit_flops if c.completes else 0)
            flops += (prefill_attention_flops(self.shape, end)
                      - prefill_attention_flops(self.shape, c.start))
            tokens += c.tokens
            kv_tokens += end
        if decodes:
            flops += decodes * (self.linear_flops + self.logit_flops)
            flops += self.attention_flops * context_sum
        nbytes = self._weights(tokens) + kv_tokens * self.kv_bytes_per_token_rank
        return max(flops / self.tp / self.flop_rate, nbytes / self.byte_rate)


def streams_seconds(per_seq_s: float, knee: int, past_knee_s: float, streams: float) -> float:
    """The part of a decode step that grows with its streams (their contexts aside):
    per_seq_s x B + past_knee_s x max(0, B - knee), B = `streams`."""
    return per_seq_s * streams + past_knee_s * max(0.0, streams - knee)


def _check_coefficient(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        value >= 0 and math.isfinite(value)
    ):
        raise ValueError(f"calibration profile: {field} must be a finite number >= 0, "
                         f"got {value!r}")


@dataclass(frozen=True)
class CalibrationProfile:
    """Fitted step costs of one machine and model (formulas in the module docstring)."""

    decode_overhead_s: float
    decode_per_seq_s: float
    prefill_per_token_s: float
    prefill_overhead_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    prefill_per_attention_pair_s: float = 0.0
    # past decode_knee_batch streams, each further stream costs decode_per_seq_past_knee_s
    # more (0 and 0: one per-stream cost at every batch)
    decode_knee_batch: int = 0
    decode_per_seq_past_knee_s: float = 0.0
    model: str | None = None
    gpu: str | None = None
    tp: int = 1
    source: str = ""
    fit_rows: int | None = None
    max_rel_error: float | None = None
    median_rel_error: float | None = None

    def __post_init__(self) -> None:
        for name in ("decode_overhead_s", "decode_per_seq_s", "prefill_per_token_s",
                     "prefill_overhead_s", "decode_per_context_token_s",
                     "prefill_per_attention_pair_s", "decode_per_seq_past_knee_s"):
            _check_coefficient(f"{name.split('_')[0]}.{name.split('_', 1)[1]}",
                               getattr(self, name))
        knee = self.decode_knee_batch
        if isinstance(knee, bool) or not isinstance(knee, int) or knee < 0:
            raise ValueError(f"calibration profile: decode.knee_batch must be an integer >= 0, "
                             f"got {knee!r}")
        if not knee and self.decode_per_seq_past_knee_s:
            raise ValueError("calibration profile: decode.per_seq_past_knee_s needs a "
                             "decode.knee_batch >= 1 (the batch it applies past)")
        if self.decode_overhead_s + self.decode_per_seq_s <= 0:
            raise ValueError("calibration profile: decode.overhead_s + decode.per_seq_s must be "
                             "positive (a decode step takes time)")
        if self.prefill_per_token_s <= 0:
            raise ValueError("calibration profile: prefill.per_token_s must be positive")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"calibration profile: tp must be an integer >= 1, got {self.tp!r}")

    def step_seconds(self, chunks: Sequence[Chunk], decodes: int, context_sum: int) -> float:
        return self.counted_step_seconds(sum(c.tokens for c in chunks),
                                         sum(map(attention_pairs, chunks)), decodes, context_sum)

    def counted_step_seconds(self, prompt_tokens: int, attention: int, decodes: int,
                             context_sum: int) -> float:
        """A step by its counts (a recorded step's fields): `prompt_tokens` with `attention`
        (query, key) pairs, `decodes` decode tokens over `context_sum` context."""
        seconds, overhead = 0.0, 0.0
        if prompt_tokens:
            seconds += self.prefill_per_token_s * prompt_tokens
            seconds += self.prefill_per_attention_pair_s * attention
            overhead = self.prefill_overhead_s
        if decodes:
            seconds += streams_seconds(self.decode_per_seq_s, self.decode_knee_batch,
                                       self.decode_per_seq_past_knee_s, decodes)
            seconds += self.decode_per_context_token_s * context_sum
            overhead = max(overhead, self.decode_overhead_s)
        return overhead + seconds

    def describe(self) -> str:
        """The fitted step costs and how well they fit, in one line."""
        knee = (f" (+{self.decode_per_seq_past_knee_s * 1e3:.3f} past {self.decode_knee_batch} "
                "streams)" if self.decode_knee_batch else "")
        text = (f"decode {self.decode_overhead_s * 1e3:.2f} ms + {self.decode_per_seq_s * 1e3:.3f}"
                f" ms/seq{knee} + {self.decode_per_context_token_s * 1e6:.3f} us/context token; "
                f"prefill {self.prefill_overhead_s * 1e3:.2f} ms + "
                f"{self.prefill_per_token_s * 1e3:.3f} ms/token + "
                f"{self.prefill_per_attention_pair_s * 1e9:.2f} ns/attention pair")
        if self.median_rel_error is not None and self.max_rel_error is not None:
            text += (f"; a step within {self.median_rel_error:.0%} (median), a group's medians "
                     f"within {self.max_rel_error:.0%}")
        return text

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": PROFILE_SCHEMA, "source": self.source, "model": self.model,
            "gpu": self.gpu, "tp": self.tp,
            "decode": {"overhead_s": self.decode_overhead_s, "per_seq_s": self.decode_per_seq_s,
                       "per_context_token_s": self.decode_per_context_token_s,
                       "knee_batch": self.decode_knee_batch,
                       "per_seq_past_knee_s": self.decode_per_seq_past_knee_s},
            "prefill": {"overhead_s": self.prefill_overhead_s,
                        "per_token_s": self.prefill_per_token_s,
                        "per_attention_pair_s": self.prefill_per_attention_pair_s}}
        if self.fit_rows is not None:
            out["fit"] = {"rows": self.fit_rows, "max_rel_error": self.max_rel_error,
                          "median_rel_error": self.median_rel_error}
        return out


def profile_from_dict(data: dict[str, Any]) -> CalibrationProfile:
    """A profile from its JSON form (module docstring); ValueError naming what is wrong."""
    if data.get("schema") != PROFILE_SCHEMA:
        raise ValueError(f"calibration profile: schema must be {PROFILE_SCHEMA!r}, got "
                         f"{data.get('schema')!r}")
    decode, prefill = data.get("decode"), data.get("prefill")
    if not isinstance(decode, dict) or not isinstance(prefill, dict):
        raise ValueError("calibration profile: needs 'decode' and 'prefill' objects")
    for part, keys, obj in (("decode", ("overhead_s", "per_seq_s"), decode),
                            ("prefill", ("per_token_s",), prefill)):
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ValueError(f"calibration profile: {part} is missing {', '.join(missing)}")
    for key in ("model", "gpu"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ValueError(f"calibration profile: {key} must be a string or null, got "
                             f"{data[key]!r}")
    fit = data.get("fit") if isinstance(data.get("fit"), dict) else {}
    return CalibrationProfile(
        decode_overhead_s=decode["overhead_s"], decode_per_seq_s=decode["per_seq_s"],
        decode_per_context_token_s=decode.get("per_context_token_s", 0.0),
        decode_knee_batch=decode.get("knee_batch", 0),
        decode_per_seq_past_knee_s=decode.get("per_seq_past_knee_s", 0.0),
        prefill_overhead_s=prefill.get("overhead_s", 0.0),
        prefill_per_token_s=prefill["per_token_s"],
        prefill_per_attention_pair_s=prefill.get("per_attention_pair_s", 0.0),
        model=data.get("model"),
        gpu=data.get("gpu"), tp=data.get("tp", 1), source=str(data.get("source", "")),
        fit_rows=fit.get("rows"), max_rel_error=fit.get("max_rel_error"),
        median_rel_error=fit.get("median_rel_error"))


# ---- fitting bench rows -------------------------------------------------------------------------


class BenchPoint(NamedTuple):
    """One measured step: x (batch or tokens), its seconds t, the part of t the fit explains,
    and how many measured steps it stands for (its weight, n_i in the module docstring)."""

    x: float
    seconds: float
    fitted_part: float
    count: float = 1.0


def fit_line(points: Sequence[BenchPoint], single: str) -> tuple[float, float]:
    """(intercept, slope) by relative-error weighted least squares (module docstring);
    `single` ("intercept" or "slope") takes everything when all points share one x."""
    w = [p.count / p.seconds**2 for p in points]
    s, sx = sum(w), sum(wi * p.x for wi, p in zip(w, points, strict=True))
    st = sum(wi * p.fitted_part for wi, p in zip(w, points, strict=True))
    sxx = sum(wi * p.x**2 for wi, p in zip(w, points, strict=True))
    sxt = sum(wi * p.x * p.fitted_part for wi, p in zip(w, points, strict=True))
    if len({p.x for p in points}) < 2:
        return (st / s, 0.0) if single == "intercept" else (0.0, sxt / sxx)
    slope = (s * sxt - sx * st) / (s * sxx - sx**2)
    intercept = (st - slope * sx) / s
    if slope < 0:
        return st / s, 0.0
    if intercept < 0:
        return 0.0, sxt / sxx
    return intercept, slope


def _row_number(row: dict[str, Any], key: str, where: str, integer: bool) -> float:
    value = row.get(key)
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{where}: {key} must be a positive {'integer' if integer else 'number'}"
                         f", got {value!r}")
    return value


def _bench_point(row: Any, where: str, context_token_s: float) -> BenchPoint | Point:
    """A decode row's step (x = B), or a prefill row's (x = tokens computed, y = their
    attention pairs)."""
    if not isinstance(row, dict) or row.get("phase") not in ("decode", "prefill"):
        raise ValueError(f"{where}: expected a `pdserve bench engine --json` row with phase "
                         "'decode' or 'prefill'")
    batch = _row_number(row, "batch", where, integer=True)
    prompt = _row_number(row, "prompt_tokens", where, integer=True)
    tok_s = _row_number(row, "pdserve_tok_s", where, integer=False)
    if row["phase"] == "decode":
        seconds = batch / tok_s
        return BenchPoint(batch, seconds, seconds - context_token_s * batch * prompt)
    # a prefix-cache row's tok/s counts the tokens it computed, not the cached ones
    cached = row.get("cached_tokens", 0)
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < prompt:
        raise ValueError(f"{where}: cached_tokens must be an integer in [0, prompt_tokens), got "
                         f"{cached!r}")
    pairs = batch * attention_pairs(Chunk(cached, int(prompt) - cached, True))
    computed = batch * (prompt - cached)
    return Point(computed, pairs, computed / tok_s, 1)


def fit_prefill(points: Sequence[Point]) -> nnls.Coefficients | None:
    """(overhead, per_token, per_attention_pair) of prefill steps at points (x = tokens, y =
    attention pairs) by nnls.py, every one >= 0 and per_token > 0; None when no support
    gives a positive per-token cost."""
    return nnls.fit(points, PREFILL_SUPPORTS, lambda c: c[1] > 0)


def fit_bench_rows(rows: Sequence[Any], context_token_s: float = 0.0, source: str = "",
                   model: str | None = None, gpu: str | None = None,
                   tp: int = 1) -> CalibrationProfile:
    """A profile fitted to bench rows (module docstring); needs a decode and a prefill row."""
    decode: list[BenchPoint] = []
    prefill: list[Point] = []
    for i, row in enumerate(rows, start=1):
        point = _bench_point(row, f"{source or 'bench results'} row {i}", context_token_s)
        if isinstance(point, Point):
            prefill.append(point)
        else:
            decode.append(point)
    for phase, found in (("decode", decode), ("prefill", prefill)):
        if not found:
            raise ValueError(f"{source or 'bench results'}: no {phase} row to fit")
    d0, d1 = fit_line(decode, single="intercept")
    coef = fit_prefill(prefill)
    if coef is None:
        raise ValueError(f"{source or 'bench results'}: prefill rows give no positive "
                         "per-token cost")
    errors = [abs(d0 + d1 * p.x - p.fitted_part) / p.seconds for p in decode]
    return CalibrationProfile(
        decode_overhead_s=d0, decode_per_seq_s=d1, decode_per_context_token_s=context_token_s,
        prefill_overhead_s=coef[0], prefill_per_token_s=coef[1],
        prefill_per_attention_pair_s=coef[2], model=model, gpu=gpu, tp=tp, source=source,
        fit_rows=len(rows),
        max_rel_error=max(*errors, nnls.max_rel_error(prefill, lambda p: nnls.predict(p, coef))))


def context_token_seconds(kv_bytes_per_token_rank: int, hardware: Hardware,
                          efficiency: Efficiency) -> float:
    """The roofline's KV read per context token per decode step: bytes / (bandwidth x MBU)."""
    return kv_bytes_per_token_rank / (hardware.memory_bandwidth * efficiency.mbu)


class BenchRows(NamedTuple):
    """Parsed `pdserve bench engine --json` rows, not yet fitted (fitting needs the model)."""

    source: str
    rows: list[Any]


def load_calibration(path: str | Path) -> CalibrationProfile | BenchRows:
    """A profile JSON file (an object with "schema"), else JSONL bench rows to fit."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"calibrate (--calibrate) {str(path)!r} cannot be read: "
                         f"{e.strerror}") from e
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and "schema" in whole:
        return profile_from_dict(whole)
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"calibrate {path} line {number}: not valid JSON "
                                 f"({e.msg})") from e
    return BenchRows(f"pdserve bench engine rows from {path}", rows)
