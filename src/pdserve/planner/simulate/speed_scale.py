"""A calibration scaled to the machine's speed when another run was measured.

A shared machine's speed drifts between runs by more than the simulator's model misses. So
`pdserve bench compare` times two fixed engine jobs (a 512-token prefill of the run's model,
and decode steps of 8 streams) right before and right after each pdserve run, on the threads
that configuration's workers compute on (bench/speed_reference.py), and keeps them in the
results as

    "speed_reference": {"threads": T, "prefill_tokens": P, "prefill_s": [before, after],
                        "decode_streams": S, "decode_prompt_tokens": Q,
                        "decode_step_s": [before, after]}

(the decode job's three keys are absent in results written before it was timed).

With the calibration run A's reference and the held-out run B's (same job), every fitted cost
of the profile (overheads, per token, per attention pair, per stream, per context token) is
priced at B's speed:

    cost x f,    f = mean(B.prefill_s) / mean(A.prefill_s)

except a decode cost per context token held at a value measured apart (--decode-context-us):
it was not measured at A's speed, and stays as given. The mean of the two timings stands for
the whole run: one timing is a snapshot (the same job a minute apart differed by up to 16%
here), and bracketing halves its variance. By default one factor for every kind of cost; a
second, for the decode terms, is what `--speed-reference split` gives:

    prompt terms x f,   decode terms (overhead, per stream, past the knee) x d,
    d = mean(B.decode_step_s) / mean(A.decode_step_s)

and the per-context-token term x d unless held. The default stays one factor until runs show
the second one predicts better (docs/benchmarks.md); `decode_factor` is reported beside it
either way. A held-out run of several rounds (`bench compare --repeats`, its figures medians
over them) is priced at all its rounds' timings pooled (`read_rounds_reference`); a
calibration at the timings of the rounds its steps come from (`read_steps_reference`): every
round's where bench compare kept every round's steps (`steps_rounds`), else the last round's.

Refused (ValueError): references of different jobs (threads, prompt tokens): the runs'
workers did not compute on the same threads, or the job changed between versions; `split`
when either run lacks the decode job's timings.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

from pdserve.common.numbers import is_finite_number
from pdserve.planner.simulate.calibration import CalibrationProfile

KEY = "speed_reference"
# `--speed-reference`: scale by the prefill job; scale the prompt terms by the prefill job and
# the decode terms by the decode job; price at the calibration run's speed; or, a diagnostic,
# at the measured run's own steps' speed window by window (speed_timeline.py)
SPEED_REFERENCE_MODES = ("scale", "split", "ignore", "steps")
DECODE_KEYS = ("decode_streams", "decode_prompt_tokens", "decode_step_s")


@dataclass(frozen=True)
class SpeedReference:
    """The job's shape and its timings (seconds) around one run, in the order taken."""

    threads: int
    prefill_tokens: int
    prefill_s: tuple[float, ...]
    # the decode job: (streams, prompt tokens) and its timings; None and (): not timed
    decode_job: tuple[int, int] | None = None
    decode_step_s: tuple[float, ...] = ()

    @property
    def job(self) -> tuple[int, int]:
        return self.threads, self.prefill_tokens

    def describe(self) -> str:
        return f"a {self.prefill_tokens}-token prefill on {self.threads} threads"


def read_speed_reference(result: dict[str, Any], label: str) -> SpeedReference | None:
    """The run's `speed_reference`; None without one (an older file, --no-speed-reference, an
    external server). ValueError naming the run for a malformed one."""
    ref = result.get(KEY)
    if ref is None:
        return None
    if not isinstance(ref, dict) or not all(_count(ref.get(k)) for k in
                                            ("threads", "prefill_tokens")) or \
            not _timings(ref.get("prefill_s")):
        raise ValueError(f"{label}: {KEY} must be {{\"threads\", \"prefill_tokens\": n >= 1, "
                         f"\"prefill_s\": [seconds > 0, ...]}}, got {str(ref)[:80]}")
    known = [k for k in DECODE_KEYS if k in ref]
    if known and (known != list(DECODE_KEYS) or not _count(ref["decode_streams"]) or
                  not _count(ref["decode_prompt_tokens"]) or not _timings(ref["decode_step_s"])):
        raise ValueError(f"{label}: {KEY}'s decode job needs \"decode_streams\", "
                         f"\"decode_prompt_tokens\": n >= 1 and \"decode_step_s\": [seconds > 0, "
                         f"...], got {', '.join(f'{k}={ref[k]!r}' for k in known)}")
    decode = (ref["decode_streams"], ref["decode_prompt_tokens"]) if known else None
    return SpeedReference(ref["threads"], ref["prefill_tokens"],
                          tuple(map(float, ref["prefill_s"])), decode,
                          tuple(map(float, ref.get("decode_step_s", ()))))


def read_rounds_reference(result: dict[str, Any], label: str) -> SpeedReference | None:
    """The reference that goes with a run's figures. With `repeats` (`bench compare --repeats
    N`: each figure the median over N rounds, the steps and `speed_reference` the last
    round's), every round's timings of the job pooled, so that the figures are priced at the
    speed of all the rounds they come from; None where a round has none or the rounds timed
    different jobs. Without: `read_speed_reference`."""
    rounds = result.get("repeats")
    if not isinstance(rounds, list) or not rounds:
        return read_speed_reference(result, label)
    refs = [read_speed_reference(r if isinstance(r, dict) else {}, f"{label} round {i}")
            for i, r in enumerate(rounds, start=1)]
    known = [r for r in refs if r is not None]
    if len(known) != len(refs) or len({r.job for r in known}) != 1:
        return None
    decoded = len({r.decode_job for r in known}) == 1 and known[0].decode_job is not None
    return SpeedReference(known[0].threads, known[0].prefill_tokens,
                          tuple(t for r in known for t in r.prefill_s),
                          known[0].decode_job if decoded else None,
                          tuple(t for r in known for t in r.decode_step_s) if decoded else ())


def read_steps_reference(result: dict[str, Any], label: str) -> SpeedReference | None:
    """The reference that goes with the steps beside a run's results: bench compare's
    `steps_rounds` (how many rounds' steps its .steps.json holds; absent: one, the last) equal
    to its rounds, every round's timings pooled (`read_rounds_reference`); else the last
    round's (`read_speed_reference`). ValueError for a `steps_rounds` that is not 1 or the
    number of rounds."""
    rounds = result.get("repeats")
    count = len(rounds) if isinstance(rounds, list) and rounds else 1
    kept = result.get("steps_rounds", 1)
    if kept not in (1, count) or isinstance(kept, bool):
        raise ValueError(f"{label}: steps_rounds must be 1 or the run's {count} rounds, "
                         f"got {kept!r}")
    return read_rounds_reference(result, label) if kept > 1 else \
        read_speed_reference(result, label)


@dataclass(frozen=True)
class SpeedScale:
    """The calibration's factors to a measured run's speed: `prefill` the prefill job's (f),
    `decode` the decode job's (d; None: not timed by both runs); `split`: the decode terms are
    priced by d (--speed-reference split), else d is only reported."""

    prefill: float
    decode: float | None = None
    split: bool = False


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _timings(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        is_finite_number(t) and t > 0 for t in value)


def speed_factor(calibration: SpeedReference, measured: SpeedReference) -> float:
    """f above (above 1: the measured run's machine was slower); ValueError when the two timed
    different jobs."""
    if calibration.job != measured.job:
        raise ValueError(f"the speed references timed different jobs (calibration: "
                         f"{calibration.describe()}; measured: {measured.describe()}), so they "
                         "do not compare: leave the scaling out with --speed-reference ignore")
    return statistics.fmean(measured.prefill_s) / statistics.fmean(calibration.prefill_s)


def decode_factor(calibration: SpeedReference, measured: SpeedReference) -> float | None:
    """d above; None unless both runs timed the same decode job."""
    if calibration.decode_job is None or calibration.decode_job != measured.decode_job or \
            calibration.threads != measured.threads:
        return None
    return statistics.fmean(measured.decode_step_s) / statistics.fmean(calibration.decode_step_s)


def scale_profile(profile: CalibrationProfile, factor: float, context_held: bool,
                  decode: float | None = None) -> CalibrationProfile:
    """`profile` priced at the measured run's speed (the module docstring): every term by
    `factor`, or, given `decode` (split), the decode terms by that."""
    d = factor if decode is None else decode
    how = f"x{factor:.3f}" if decode is None else f"x{factor:.3f} (prompt), x{d:.3f} (decode)"
    return _times(profile, factor, d, 1.0 if context_held else d,
                  f"{profile.source}, scaled {how} by the speed references")


def _times(profile: CalibrationProfile, prompt: float, decode: float, context: float,
           source: str) -> CalibrationProfile:
    """`profile` with its prompt terms times `prompt`, its decode overhead and per-stream
    terms times `decode` and its per-context-token term times `context`."""
    return replace(profile,
                   prefill_overhead_s=profile.prefill_overhead_s * prompt,
                   prefill_per_token_s=profile.prefill_per_token_s * prompt,
                   prefill_per_attention_pair_s=profile.prefill_per_attention_pair_s * prompt,
                   decode_overhead_s=profile.decode_overhead_s * decode,
                   decode_per_seq_s=profile.decode_per_seq_s * decode,
                   decode_per_seq_past_knee_s=profile.decode_per_seq_past_knee_s * decode,
                   decode_per_context_token_s=profile.decode_per_context_token_s * context,
                   source=source)


COST_KINDS = ("prefill", "decode")  # `--scale-costs`: the profile's two families of terms


def parse_cost_scale(text: str) -> dict[str, float]:
    """`--scale-costs KIND=F[,KIND=F]` (KIND of COST_KINDS, F > 0 and finite): ValueError
    saying what is wrong otherwise."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, eq, value = part.partition("=")
        if not eq or kind.strip() not in COST_KINDS:
            raise ValueError(f"--scale-costs takes KIND=FACTOR with KIND one of "
                             f"{', '.join(COST_KINDS)}, got {part!r}")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"--scale-costs {kind.strip()}: the factor must be a positive "
                             f"number, got {value.strip()!r}")
        out[kind.strip()] = factor
    if not out:
        raise ValueError("--scale-costs needs at least one KIND=FACTOR (prefill, decode)")
    return out


def scale_costs(profile: CalibrationProfile, factors: dict[str, float]) -> CalibrationProfile:
    """`profile` with its prompt terms (overhead, per token, per attention pair) times
    factors["prefill"] and its decode terms (overhead, per stream, per context token, a held
    one included) times factors["decode"]: a what-if price, given by the user."""
    f, d = factors.get("prefill", 1.0), factors.get("decode", 1.0)
    return _times(profile, f, d, d, f"{profile.source}, prompt costs x{f:g} and decode costs "
                                    f"x{d:g} (--scale-costs)")
