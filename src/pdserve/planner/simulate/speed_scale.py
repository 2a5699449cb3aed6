"""A calibration scaled to the machine's speed when another run was measured.

A shared machine's speed drifts between runs by more than the simulator's model misses. So
`pdserve bench compare` times one fixed engine job right before and right after each pdserve
run, on the threads that configuration's workers compute on (bench/speed_reference.py), and
keeps it in the results as

    "speed_reference": {"threads": T, "prefill_tokens": P, "decode_batch": B,
                        "prefill_s": [before, after], "decode_step_s": [before, after]}

With the calibration run A's reference and the held-out run B's (same job), the profile fitted
on A is priced at B's speed:

    a = mean(B.prefill_s) / mean(A.prefill_s)            (the prompt: compute-bound)
    d = mean(B.decode_step_s) / mean(A.decode_step_s)    (the streams: memory-bound)

    prefill overhead, per token and per attention pair  x a
    decode overhead and per stream                       x d
    decode per context token                             x d, unless it is held: a value
                                                         measured apart (--decode-context-us),
                                                         not at A's speed, stays as given

A mixed step's parts scale by their kind. The mean of the two timings stands for the whole
run: one timing is a snapshot (the same job a minute apart differed by up to 16% in prefill and
50% in a one-thread decode step here), and bracketing halves its variance.

Refused (ValueError): references of different jobs (threads, prompt tokens, batch): the
runs' workers did not compute on the same threads, or the job changed between versions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

from pdserve.planner.simulate.calibration import CalibrationProfile

KEY = "speed_reference"


@dataclass(frozen=True)
class SpeedReference:
    """The job's shape and its timings (seconds) around one run, in the order taken."""

    threads: int
    prefill_tokens: int
    decode_batch: int
    prefill_s: tuple[float, ...]
    decode_step_s: tuple[float, ...]

    @property
    def job(self) -> tuple[int, int, int]:
        return self.threads, self.prefill_tokens, self.decode_batch

    def describe(self) -> str:
        return (f"{self.threads} threads, a {self.prefill_tokens}-token prefill and "
                f"{self.decode_batch}-stream decode steps")


@dataclass(frozen=True)
class SpeedScale:
    """B's time over A's, per kind of work: above 1, B ran on a slower machine."""

    prefill: float
    decode: float


def read_speed_reference(result: dict[str, Any], label: str) -> SpeedReference | None:
    """The run's `speed_reference`; None without one (an older file, --no-speed-reference, an
    external server). ValueError naming the run for a malformed one."""
    ref = result.get(KEY)
    if ref is None:
        return None
    shape = ("threads", "prefill_tokens", "decode_batch")
    if not isinstance(ref, dict) or not all(_count(ref.get(k)) for k in shape) or not all(
            _timings(ref.get(k)) for k in ("prefill_s", "decode_step_s")):
        raise ValueError(f"{label}: {KEY} must be {{\"threads\", \"prefill_tokens\", "
                         f"\"decode_batch\": n >= 1, \"prefill_s\", \"decode_step_s\": "
                         f"[seconds > 0, ...]}}, got {str(ref)[:80]}")
    return SpeedReference(ref["threads"], ref["prefill_tokens"], ref["decode_batch"],
                          tuple(map(float, ref["prefill_s"])),
                          tuple(map(float, ref["decode_step_s"])))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _timings(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) and t > 0
        for t in value)


def speed_scale(calibration: SpeedReference, measured: SpeedReference) -> SpeedScale:
    """a and d above; ValueError when the two timed different jobs."""
    if calibration.job != measured.job:
        raise ValueError(f"the speed references timed different jobs (calibration: "
                         f"{calibration.describe()}; measured: {measured.describe()}), so they "
                         "do not compare: leave the scaling out with --speed-reference ignore")
    return SpeedScale(
        statistics.fmean(measured.prefill_s) / statistics.fmean(calibration.prefill_s),
        statistics.fmean(measured.decode_step_s) / statistics.fmean(calibration.decode_step_s))


def scale_profile(profile: CalibrationProfile, scale: SpeedScale, context_held: bool
                  ) -> CalibrationProfile:
    """`profile` priced at the measured run's speed (the module docstring)."""
    a, d = scale.prefill, scale.decode
    context = profile.decode_per_context_token_s * (1.0 if context_held else d)
    return replace(profile,
                   prefill_overhead_s=profile.prefill_overhead_s * a,
                   prefill_per_token_s=profile.prefill_per_token_s * a,
                   prefill_per_attention_pair_s=profile.prefill_per_attention_pair_s * a,
                   decode_overhead_s=profile.decode_overhead_s * d,
                   decode_per_seq_s=profile.decode_per_seq_s * d,
                   decode_per_context_token_s=context,
                   source=f"{profile.source}, scaled x{a:.3f} prefill and x{d:.3f} decode by "
                          "the speed references")
