"""The front end's round trip, fitted to a calibration run: what its TTFTs hold beyond its steps.

`pdserve bench compare --out cmp.json` writes the run's requests (cmp.json) beside its workers'
steps (cmp.steps.json). The step costs come from the steps alone (step_fit.py). The time from a
client sending a request to the worker receiving it, and from a step's end to the client
reading its token (the router, HTTP both ways, the client's own parsing), is in no step; the
simulator adds it as one round trip L (cluster.py `frontend_latency_s`).

Measured, when the run has them: `bench compare` sends a few one-token probes to the idle
cluster after the run (bench/frontend_probe.py). Where it also kept each probe's own prompt
step from the workers' traces, L = min over probes of (TTFT - its step's seconds): what a
request spends outside the engine, measured without the cost model. Otherwise L = their
fastest TTFT less the simulated TTFT of one such request alone on the same layout, which is
clamped at 0 wherever the fit prices a small prompt step above its measure (a 32-token step
priced at ~31 ms against probes of 25-28 ms): a closed loop's next request then joins the
next step at once (below), where measured it waits for the step already started (26-28 ms at
the median in a chat run whose median TTFTs came out 16-27% short). Nothing queues there,
so the queue model's errors cannot enter L either way.

The fastest, not the median: anything else that holds a core while they run (a run's stray
work, another process on the machine) only adds to a probe, and the idle round trip is the
floor they find, as a ping's is its least round trip. After a diurnal run that shared the
machine with another process, collocated's probes took 529, 757, 1,259, 398 and 31 ms (the
other configurations' 25-56 ms), and their median put half a second of front end into every
TTFT simulated from that calibration (+240-350%).

Fitted, for a run without probes: the L with which the calibration run, replayed on its own
layout with the fitted costs, shows its measured `QUANTILE` (10th percentile) TTFT:

    L_0 = 0,  L_{k+1} = max(0, L_k + measured q10 TTFT - simulated q10 TTFT(L_k)),

stopping once a step moves L by under `CONVERGED_S` (at most `MAX_ROUNDS`). In an open loop L
adds to every TTFT, so one step lands on it; in a closed loop it also moves the next request's
arrival past the step that ended the last one (it waits for a step it would otherwise have
joined at once), which the further steps follow. A low quantile, not the median: the fastest
TTFTs are the requests that queued least, where the model's queues cannot be wrong by much; a
calibration run that kept its workers near saturation has a median TTFT made of queueing, and
any error of the queue model there would be taken for front-end time (a diurnal run's median
fitted 0.2 s collocated and 1.2 s disaggregated, its 10th percentile 0 and 0.1 s). Quantiles
as numpy's default (linear between order statistics), both sides.

Why it matters most for closed loops: with L = 0 a client's next request reaches the worker at
the very end of the step that finished its last one and always joins the next step, a timing no
real client has; a chat run at 16 clients then shows TTFTs a whole step too short.

Limit: one constant, measured idle (or fitted at the run's own load). A front end that slows
with load (on a CPU machine the router and the clients share the cores with the workers) is
priced idle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pdserve.planner.simulate.admission import Admission
from pdserve.planner.simulate.calibration import StepCosts
from pdserve.planner.simulate.calibration_pool import own_config
from pdserve.planner.simulate.cluster import Cluster, Layout
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.file_spec import STEPS_SUFFIX, parse_file_spec, results_path
from pdserve.planner.simulate.measured_run import MeasuredRun, load_measured_run
from pdserve.planner.simulate.trace import TraceRequest

QUANTILE = 0.1
CONVERGED_S = 1e-3
MAX_ROUNDS = 8


def calibration_run(spec_text: str, flag: str) -> MeasuredRun | None:
    """The run whose steps FILE.steps.json:CONFIG holds (of A+B: A's, calibration_pool.py):
    CONFIG of FILE.json beside it; None without :CONFIG (pooled configurations ran on
    different layouts), for another file name, or when FILE.json is missing or lacks CONFIG."""
    spec = parse_file_spec(spec_text, flag)
    config = own_config(spec.config)
    if config is None or not spec.path.name.endswith(STEPS_SUFFIX):
        return None
    results = results_path(spec.path)
    if not results.is_file():
        return None
    try:
        return load_measured_run(f"{results}:{config}", flag)
    except ValueError:  # not a results file, or one without that configuration
        return None


def fit_frontend_latency(run: MeasuredRun, layout: Layout, cluster: Cluster, costs: StepCosts
                         ) -> float:
    """L (seconds): from the run's idle probes when it has them, else by the module
    docstring's iteration; 0 when the run recorded no TTFT. The run is replayed as a pdserve
    configuration is served: behind the router's admission (its defaults)."""
    cluster = replace(cluster, admission=Admission())
    if run.probed and run.probe_steps_s:
        return max(0.0, min(t - s for t, s in zip(run.probe_ttfts_s, run.probe_steps_s,
                                                    strict=True)))
    if run.probed and run.probe_prompt_tokens is not None:
        return _from_probes(run.probe_prompt_tokens, run.probe_ttfts_s, layout, cluster, costs)
    if not run.ttfts_s:
        return 0.0
    measured = quantile(run.ttfts_s, QUANTILE)
    latency = 0.0
    for _ in range(MAX_ROUNDS):
        simulated = _simulated_quantile(run, layout, cluster, costs, latency)
        if simulated is None:  # no simulated request finished: nothing to fit to
            return 0.0
        step = measured - simulated
        latency = max(0.0, latency + step)
        if abs(step) < CONVERGED_S or latency == 0.0:
            break
    return latency


def latency_source(run: MeasuredRun) -> str:
    """How `fit_frontend_latency` finds L for `run`, for the output."""
    if run.probed and run.probe_steps_s:
        return f"from the idle probes of {run.label} less their own steps"
    if run.probed:
        return f"from the idle probes of {run.label}"
    return f"fitted to the 10th-percentile TTFT of {run.label}"


def _from_probes(tokens: int, ttfts: Sequence[float], layout: Layout, cluster: Cluster,
                 costs: StepCosts) -> float:
    """The probes' fastest TTFT (module docstring) less the simulated TTFT of one such
    request on the idle layout (its own prompt step, nothing queued), at least 0."""
    alone = simulate(layout, replace(cluster, frontend_latency_s=0.0), costs,
                     [TraceRequest(0.0, tokens, 1)]).records[0]
    return max(0.0, min(ttfts) - alone.ttft_s)


def _simulated_quantile(run: MeasuredRun, layout: Layout, cluster: Cluster, costs: StepCosts,
                        latency: float) -> float | None:
    result = simulate(layout, replace(cluster, frontend_latency_s=latency), costs, run.trace,
                      clients=run.clients, warm_up=run.warm_up)
    ttfts = [r.ttft_s for r in result.records if r.ok and r.first_token_s is not None]
    return quantile(ttfts, QUANTILE) if ttfts else None


def quantile(values: Sequence[float], q: float) -> float:
    """numpy's default quantile: linear between the order statistics at rank q (n - 1)."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

