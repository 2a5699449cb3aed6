"""`pdserve bench simulator-repeat A B`: is a held-out miss noise or the model's?

Reads two `pdserve bench simulator` summaries (A/simulator_check.json, B/...: the same
workloads and configurations measured twice, at different times) and, per (workload,
configuration, figure), sets the run-to-run change of the measured figure, (B - A) / A,
beside each run's simulated error. A figure is:
- `noise` when its measured change alone is over the figure's tolerance: one run cannot be
  predicted within the tolerance of the other, whatever the model (measured_spread.py, the
  rule `bench simulator --repeats` applies to its rounds too);
- `model` when both runs miss it on the same side (the simulation over, or under, both
  times) and the measured change is within tolerance: a miss that repeats;
- `one run` when only one run misses it (and the change is within tolerance);
- `within` otherwise.
Reading only: nothing is measured or simulated again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdserve.bench.measured_spread import apart
from pdserve.bench.measured_spread import change as changed
from pdserve.bench.simulator_check import FIGURES

VERDICTS = ("noise", "model", "one run", "within")


def load(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(workload, config) -> the row of FOLDER/simulator_check.json."""
    path = folder / "simulator_check.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run `pdserve bench simulator --out {folder}`")
    return {(r["workload"], r["config"]): r for r in json.loads(path.read_text())["rows"]}


def compare(a: dict[tuple[str, str], dict[str, Any]], b: dict[tuple[str, str], dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """One entry per figure of every (workload, config) in both summaries."""
    out = []
    for key in (k for k in a if k in b):
        ra, rb = a[key], b[key]
        for f in FIGURES:
            ma, mb = ra["measured"].get(f), rb["measured"].get(f)
            ea, eb = ra["rel_error"].get(f), rb["rel_error"].get(f)
            if None in (ma, mb, ea, eb) or ma == 0:
                continue
            tol = ra["tolerance"][f]
            out.append({"workload": key[0], "config": key[1], "figure": f, "measured_a": ma,
                        "measured_b": mb, "change": changed(ma, mb), "error_a": ea,
                        "error_b": eb, "tolerance": tol,
                        "verdict": _verdict(apart((ma, mb), tol), ea, eb, tol)})
    return out


def _verdict(noise: bool, error_a: float, error_b: float, tol: float) -> str:
    if noise:
        return "noise"
    miss_a, miss_b = abs(error_a) > tol, abs(error_b) > tol
    if miss_a and miss_b and (error_a > 0) == (error_b > 0):
        return "model"
    return "one run" if miss_a or miss_b else "within"


def format_repeat(entries: list[dict[str, Any]]) -> str:
    """The figures that are not `within`, then a count per verdict."""
    lines = ["workload  config  figure  measured A -> B (change)  error A, B  verdict"]
    for e in entries:
        if e["verdict"] != "within":
            lines.append(f"{e['workload']}  {e['config']}  {e['figure']}  "
                         f"{e['measured_a']:.3g} -> {e['measured_b']:.3g} ({e['change']:+.0%})  "
                         f"{e['error_a']:+.0%}, {e['error_b']:+.0%}  {e['verdict']}")
    counts = {v: sum(e["verdict"] == v for e in entries) for v in VERDICTS}
    lines.append(f"{len(entries)} figures: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return "\n".join(lines)


def run_simulator_repeat_cli(args: argparse.Namespace) -> int:
    entries = compare(load(args.a), load(args.b))
    if not entries:
        raise ValueError(f"{args.a} and {args.b} share no (workload, configuration) row")
    if args.json:
        for e in entries:
            print(json.dumps(e))
    else:
        print(format_repeat(entries))
    return 0
