"""What `pdserve simulate --calibrate FILE[:CONFIG]` reads, told apart by the file's shape.

- a calibration profile JSON (an object with "schema") -> that profile (calibration.py);
- a steps file (step_fit.is_steps_file): `pdserve bench compare`'s cmp.steps.json,
  {config: {worker: [[start_s, end_s, prefill_tokens, decode_tokens, num_requests,
  decode_context], ...]}} (5-field steps of older traces: contexts unknown), or one
  configuration's {worker: [...]} -> fitted at once by step_fit.fit_step_traces. FILE:CONFIG
  takes that configuration's workers only; FILE alone pools every worker of every configuration,
  which is right only when all of them ran on the same hardware: bench compare's disagg splits
  its cores between the prefill and the decode worker, so its steps are slower than those of a
  collocated worker on all the cores. Calibrate on the configuration you simulate, or
  FILE:A+B on it (A) and others that computed on the same threads (calibration_pool.py).
- a bench serve or compare results file (an object with "requests", or of configurations that
  have them) is refused: its steps are in the .steps.json beside it;
- anything else: `pdserve bench engine --json` rows (JSONL), fitted once the model is known.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pdserve.planner.simulate.calibration import BenchRows, CalibrationProfile, load_calibration
from pdserve.planner.simulate.calibration_pool import pooled_steps
from pdserve.planner.simulate.file_spec import (
    parse_file_spec,
    parse_json_document,
    read_text,
    refuse_config,
    steps_path,
)
from pdserve.planner.simulate.step_fit import fit_step_traces, is_steps_file

FLAG = "calibrate (--calibrate)"


class StepsProfile(NamedTuple):
    """A profile fitted to worker steps: it names no model or device; the command line does."""

    profile: CalibrationProfile


def _is_results(data: Any) -> bool:
    if not isinstance(data, dict) or not data:
        return False
    return "requests" in data or all(isinstance(v, dict) and "requests" in v
                                     for v in data.values())


def load_calibration_source(spec_text: str, decode_time: str = "period",
                            context_token_s: float | None = None
                            ) -> CalibrationProfile | BenchRows | StepsProfile:
    """The calibration `spec_text` (FILE or FILE:CONFIG) names, by the module docstring;
    `context_token_s` holds a steps file's decode cost per context token
    (step_fit.fit_step_traces) and is refused for any other file."""
    spec = parse_file_spec(spec_text, FLAG)
    data = parse_json_document(read_text(spec))
    if is_steps_file(data):
        held = "" if context_token_s is None else \
            f", decode context cost held at {context_token_s * 1e6:g} us/token"
        profile = fit_step_traces(pooled_steps(data, spec), decode_time,
                                  source=f"pdserve worker steps of {spec}{held}",
                                  context_token_s=context_token_s)
        return StepsProfile(profile)
    if context_token_s is not None:
        raise ValueError("--decode-context-us holds a cost while fitting worker steps; "
                         f"{spec.path} is not a .steps.json")
    if _is_results(data):
        raise ValueError(f"{FLAG} {spec.path} is a bench results file; calibrate on the worker "
                         f"steps beside it ({steps_path(spec.path)})")
    refuse_config(spec, _what(data))
    return load_calibration(spec.path)


def _what(data: Any) -> str:
    return "a calibration profile" if isinstance(data, dict) and "schema" in data else (
        "a bench engine results file")

