"""One calibration fitted to the steps of several configurations of one run:
`--calibrate FILE.steps.json:A+B[+...]`.

What a step costs is the engine's: the model, the hardware and the threads it computes on, not
the scheduler that put the step together. So the configurations of one `pdserve bench compare`
run whose workers computed on the same threads (collocated and collocated-chunked: one worker
on every core) measured the same costs, and their steps pooled give the fit more of each kind.
It matters most for chunked serving, which leaves few decode-only steps to fit (its prompts
share steps with the streams): a slow stretch of its few minutes is otherwise priced into
every run simulated from them.

A, the first name, is the configuration the calibration stands for: its run gives the front
end's round trip (frontend_fit.py) and the speed reference the profile is scaled from
(speed_scale.py). Each other configuration X ran minutes apart, at the machine's speed then,
so its steps are priced at A's speed before they join: every step's start and end times (so
its duration and its period alike) are multiplied by

    g = mean(A.prefill_s) / mean(X.prefill_s),

speed_scale.py's factor of the prefill job, one for every kind of step (a mixed step is not
split into its prompt and decode parts), each reference that of the rounds whose steps the file
holds (speed_scale.read_steps_reference).

Refused (ValueError, naming the argument): a name given twice, a configuration the steps file
lacks, no readable results file beside the steps (FILE.json) or a configuration without a
speed reference in it, and configurations whose references timed different jobs
(speed_scale.speed_factor): their workers did not compute on the same threads, so their steps
are not the same costs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.planner.simulate.file_spec import FileSpec, results_path
from pdserve.planner.simulate.speed_scale import (
    SpeedReference,
    read_steps_reference,
    speed_factor,
)
from pdserve.planner.simulate.step_fit import Step, select_steps

SEPARATOR = "+"


def pool_names(config: str | None) -> tuple[str, ...]:
    """The configurations `A+B` names, A first; () for none. ValueError for an empty name or
    one given twice."""
    if config is None:
        return ()
    names = tuple(n.strip() for n in config.split(SEPARATOR))
    if not all(names):
        raise ValueError(f"an empty configuration name in {config!r}: write A or A{SEPARATOR}B")
    if len(set(names)) != len(names):
        raise ValueError(f"a configuration named twice in {config!r}")
    return names


def own_config(config: str | None) -> str | None:
    """The configuration a calibration `A+B` stands for: A (None for none)."""
    names = pool_names(config)
    return names[0] if names else None


def results_beside(steps: Path) -> dict[str, Any] | None:
    """The bench compare results beside a .steps.json (file_spec.results_path), None where
    there is no JSON object to read."""
    try:
        data = json.loads(results_path(steps).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _reference(results: Mapping[str, Any], config: str, label: str) -> SpeedReference | None:
    """`config`'s speed reference in `results`, None without one; ValueError (naming `label`)
    for a malformed one."""
    result = results.get(config)
    return read_steps_reference(result, label) if isinstance(result, dict) else None


def same_job_pool(results: Mapping[str, Any], config: str, configs: Sequence[str]
                  ) -> tuple[str, ...]:
    """`config`, then every other of `configs` whose speed reference in the run's `results`
    timed the same job (the threads its workers computed on): the pool `A+B` that
    `pdserve plan` and `pdserve bench simulator` calibrate `config` on; `config` alone where
    its reference is missing or malformed."""
    def job(c: str) -> tuple[int, int] | None:
        try:
            ref = _reference(results, c, c)
        except ValueError:
            return None
        return None if ref is None else ref.job
    own = job(config)
    return (config, *(c for c in configs if c != config and own is not None and job(c) == own))


def pooled_steps(data: dict[str, Any], spec: FileSpec) -> dict[str, list[Step]]:
    """step_fit.select_steps for one configuration (or none); for `A+B`, every named
    configuration's steps, each priced at A's speed (module docstring)."""
    names = pool_names(spec.config)
    if len(names) <= 1:
        return select_steps(data, replace(spec, config=names[0] if names else None))
    each = {name: select_steps(data, replace(spec, config=name)) for name in names}
    refs = _references(spec, names)
    out: dict[str, list[Step]] = {}
    for name, workers in each.items():
        g = speed_factor(refs[name], refs[names[0]])
        for worker, steps in workers.items():  # worker labels are "config/worker": distinct
            out[worker] = [s._replace(start_s=s.start_s * g, end_s=s.end_s * g) for s in steps]
    return out


def _references(spec: FileSpec, names: tuple[str, ...]) -> dict[str, SpeedReference]:
    """Each named configuration's speed reference, from the results beside the steps; all of
    one job (speed_scale.speed_factor's check, with a message that says why here)."""
    path = results_path(spec.path)
    why = (f"{spec.flag} {spec}: pooled steps are priced at {names[0]!r}'s speed by the speed "
           f"references in {path}")
    results = results_beside(spec.path)
    if results is None:
        raise ValueError(f"{why}, which cannot be read as bench compare results")
    refs: dict[str, SpeedReference] = {}
    for name in names:
        ref = _reference(results, name, f"{path}:{name}")
        if ref is None:
            raise ValueError(f"{why}, where {name!r} has none")
        refs[name] = ref
    if len({ref.job for ref in refs.values()}) > 1:
        jobs = {name: ref.describe() for name, ref in refs.items()}
        raise ValueError(f"{spec.flag} {spec}: only configurations whose workers computed on "
                         f"the same threads measured the same step costs; their speed "
                         f"references timed {jobs}")
    return refs
