"""The front end's round trip, fitted to a calibration run: what its TTFTs hold beyond its steps.

`pdserve bench compare --out cmp.json` writes the run's requests (cmp.json) beside its workers'
steps (cmp.steps.json). The step costs come from the steps alone (step_fit.py). The time from a
client sending a request to the worker receiving it, and from a step's end to the client
reading its token (the router, HTTP both ways, the client's own parsing), is in no step; the
simulator adds it as one round trip L (cluster.py `frontend_latency_s`). Fitted here as the L
with which the calibration run, replayed on its own layout with the fitted costs, shows its
measured median TTFT:

    L_0 = 0,  L_{k+1} = max(0, L_k + measured median TTFT - simulated median TTFT(L_k)),

stopping once a step moves L by under `CONVERGED_S` (at most `MAX_ROUNDS`). In an open loop L
adds to every TTFT, so one step lands on it; in a closed loop it also moves the next request's
arrival past the step that ended the last one (it waits for a step it would otherwise have
joined at once), which the further steps follow. The median, not the mean: a few requests
queued behind a burst move the mean far more than the front end does.

Why it matters most for closed loops: with L = 0 a client's next request reaches the worker at
the very end of the step that finished its last one and always joins the next step, a timing no
real client has; a chat run at 16 clients then shows TTFTs a whole step too short.

Limit: one constant. A front end that slows with load (on a CPU machine the router and the
clients share the cores with the workers) is priced at the calibration run's load.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pdserve.planner.simulate.calibration import StepCosts
from pdserve.planner.simulate.cluster import Cluster, Layout
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.file_spec import parse_file_spec
from pdserve.planner.simulate.measured_run import MeasuredRun, load_measured_run
from pdserve.planner.simulate.metrics import Slo, summarize

STEPS_SUFFIX = ".steps.json"
CONVERGED_S = 1e-3
MAX_ROUNDS = 8


def calibration_run(spec_text: str, flag: str) -> MeasuredRun | None:
    """The run whose steps FILE.steps.json:CONFIG holds: CONFIG of FILE.json beside it; None
    without :CONFIG (pooled configurations ran on different layouts), for another file name,
    or when FILE.json is missing or lacks CONFIG."""
    spec = parse_file_spec(spec_text, flag)
    if spec.config is None or not spec.path.name.endswith(STEPS_SUFFIX):
        return None
    results = results_path(spec.path)
    if not results.is_file():
        return None
    try:
        return load_measured_run(f"{results}:{spec.config}", flag)
    except ValueError:  # not a results file, or one without that configuration
        return None


def fit_frontend_latency(run: MeasuredRun, layout: Layout, cluster: Cluster, costs: StepCosts
                         ) -> float:
    """L (seconds) by the module docstring's iteration; 0 when the run has no TTFT."""
    measured = run.measured.get("median_ttft_ms")
    if measured is None:
        return 0.0
    latency = 0.0
    for _ in range(MAX_ROUNDS):
        simulated = _median_ttft_ms(run, layout, cluster, costs, latency)
        if simulated is None:  # no simulated request finished: nothing to fit to
            return 0.0
        step = (measured - simulated) / 1e3
        latency = max(0.0, latency + step)
        if abs(step) < CONVERGED_S or latency == 0.0:
            break
    return latency


def _median_ttft_ms(run: MeasuredRun, layout: Layout, cluster: Cluster, costs: StepCosts,
                    latency: float) -> float | None:
    result = simulate(layout, replace(cluster, frontend_latency_s=latency), costs, run.trace,
                      clients=run.clients)
    ttft = summarize(result.records, result.itl, Slo()).ttft
    return None if ttft is None else ttft.median_ms


def results_path(steps: Path) -> Path:
    """FILE.json for FILE.steps.json."""
    return steps.with_name(steps.name.removesuffix(STEPS_SUFFIX) + ".json")
