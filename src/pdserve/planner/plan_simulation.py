"""The plan's verdict at a load: the request shape served by each layout of the same hardware in
the simulator, ranked by predicted goodput.

Without a load `pdserve plan` judges one request by rules of thumb (plan.py). With `--rate` or
`--concurrency` it simulates instead, and the simulation's ranking is the verdict.

Layouts (`candidates`), all on one hardware budget of `workers` worker slots:
- a GPU preset: a worker is tp GPUs. colloc W and chunked W (W = workers), and disagg P + D = W
  for every P in 1..W-1.
- a CPU machine (`Hardware.cores`): `pdserve up` splits its cores evenly among its workers
  (cluster/up.py). So a collocated layout is one worker on every core (`pdserve up --collocated
  1`), with and without chunked prefill, and a disaggregated one is P + D = W workers on 1/W of
  the machine each (`Hardware.share`).
Every layout runs with pdserve's defaults: max batch PDSERVE_MAX_NUM_SEQS, chunks of
PDSERVE_CHUNK_TOKENS, prompts routed by the router's measured costs (split_model.py), local
prefills paced to the TPOT bound. KV capacity is what fits beside the weights.

Costs: the roofline of cost.py on each worker's hardware, or `calibration`:
- a `pdserve bench compare` .steps.json: each of its configurations (collocated,
  collocated-chunked, disagg) is fitted on its own workers' steps, pooled with those of the
  configurations whose workers computed on the same threads (calibration_pool.py: collocated
  and collocated-chunked, where the results beside the steps hold their speed references,
  each pool priced at its first configuration's speed), and simulated with its own
  layout and limits (measured_compare.PDSERVE_CONFIGS), and with the front-end round trip
  fitted to the run's results beside the steps when they are there (frontend_fit.py). A
  layout the file did not run is left out, with a note.
- a profile JSON or `bench engine` rows: one worker's costs, so only on a GPU preset, where
  every layout's worker is the same tp GPUs.

Trace: PLAN_REQUESTS requests of the plan's prompt and output lengths, arriving Poisson at
`rate` (seed 0), or sent by `concurrency` clients each waiting for its previous answer.

Verdict: Gc = the best collocated goodput (colloc or chunked), Gd = the best disaggregated.
Gd > (1 + MARGIN) x Gc: disaggregate; Gc > (1 + MARGIN) x Gd: collocate; otherwise (a
difference within the simulator's reach, or no layout meeting the SLO) marginal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.planner.hardware import Hardware
from pdserve.planner.plan import Plan, Verdict, kv_room_tokens
from pdserve.planner.simulate.calibration import (
    CalibrationProfile,
    RooflineCosts,
    StepCosts,
    context_token_seconds,
    fit_bench_rows,
)
from pdserve.planner.simulate.calibration_pool import SEPARATOR, results_beside, same_job_pool
from pdserve.planner.simulate.calibration_source import StepsProfile, load_calibration_source
from pdserve.planner.simulate.events import Cluster, Layout, simulate
from pdserve.planner.simulate.frontend_fit import (
    calibration_run,
    fit_frontend_latency,
    latency_source,
)
from pdserve.planner.simulate.measured_compare import (
    PDSERVE_CHUNK_TOKENS,
    PDSERVE_CONFIGS,
    PDSERVE_MAX_NUM_SEQS,
    MeasuredLayout,
)
from pdserve.planner.simulate.metrics import Slo, summarize, summary_to_dict
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.step_fit import is_steps_file
from pdserve.planner.simulate.trace import TraceRequest, generate_trace, make_workload

PLAN_REQUESTS = 200  # requests per simulated layout: a P99 of two requests, in well under 1 s
MARGIN = 0.05  # goodputs closer than 5% are a tie: within the simulator's error on one run
CALIBRATED_CONFIGS = ("collocated", "collocated-chunked", "disagg")  # bench compare's names
COLLOCATED = (Layout.COLLOC, Layout.CHUNKED)


@dataclass(frozen=True)
class Load:
    """The load to judge at: Poisson `rate` req/s (open loop) or `concurrency` clients (closed
    loop), exactly one; the SLO goodput counts by; the worker slots the layouts share."""

    rate: float | None
    concurrency: int | None
    slo: Slo
    workers: int = 2

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --rate and --concurrency to simulate the plan")
        if self.rate is not None and not (isinstance(self.rate, int | float)
                                          and 0 < self.rate < float("inf")):
            raise ValueError(f"rate (--rate) must be a positive number of req/s, got "
                             f"{self.rate!r}")
        for name, flag, value, least in (("concurrency", "--concurrency", self.concurrency, 1),
                                         ("workers", "--workers", self.workers, 2)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ValueError(f"{name} ({flag}) must be an integer >= {least}, got {value!r}")
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise ValueError("the plan's SLO needs both a TTFT and a TPOT bound")

    def describe(self) -> str:
        how = (f"Poisson {self.rate:g} req/s" if self.rate is not None
               else f"{self.concurrency} clients in closed loop")
        return (f"{PLAN_REQUESTS} requests, {how}; SLO TTFT <= {self.slo.ttft_ms:g} ms, "
                f"TPOT <= {self.slo.tpot_ms:g} ms")


@dataclass(frozen=True)
class Candidate:
    """One layout to simulate: its cluster and its workers' step costs."""

    label: str
    layout: Layout
    cluster: Cluster
    costs: StepCosts


@dataclass(frozen=True)
class LayoutResult:
    label: str
    layout: Layout
    summary: dict[str, Any]  # metrics.summary_to_dict
    local_prefills: int

    @property
    def goodput(self) -> float:
        return self.summary["request_goodput"]


@dataclass(frozen=True)
class Simulated:
    """The simulation behind a verdict: what ran, each layout's figures, the verdict."""

    load: Load
    costs: str
    results: tuple[LayoutResult, ...]
    verdict: Verdict
    reason: str
    notes: tuple[str, ...] = ()


# ---- layouts ------------------------------------------------------------------------------------


def _cluster(plan: Plan, load: Load, hw: Hardware, layout: MeasuredLayout) -> Cluster:
    """A cluster of `layout`'s workers on `hw` each, with pdserve's limits (module docstring)."""
    kv_rank = plan.kv_bytes_per_token_per_gpu
    if layout.kv_cache_bytes is not None:
        capacity = layout.kv_cache_bytes // kv_rank
    else:
        capacity = kv_room_tokens(plan.model, hw, plan.workload.tp, kv_rank)
    return Cluster(kv_capacity_tokens=capacity, kv_bytes_per_token_rank=kv_rank,
                   link_gbps=plan.workload.link_gbps,
                   prefill_workers=layout.prefill_workers or 1,
                   decode_workers=layout.decode_workers or 1,
                   collocated_workers=layout.collocated_workers or 1,
                   max_batch=layout.max_batch or PDSERVE_MAX_NUM_SEQS,
                   chunk_tokens=layout.chunk_tokens or PDSERVE_CHUNK_TOKENS,
                   split=layout.split or SplitRule.MEASURED,
                   tpot_target_s=load.slo.tpot_ms / 1e3)


def _shapes(hw: Hardware, workers: int) -> list[tuple[str, MeasuredLayout, Hardware]]:
    """(label, layout, each worker's hardware) of every candidate, by the module docstring."""
    if hw.cores is None:
        split_hw, colloc_n, every, each = hw, workers, "", ""
    else:
        split_hw, colloc_n = hw.share(workers), 1
        every, each = f" ({hw.cores} cores)", f" ({split_hw.cores} of {hw.cores} cores each)"
    shapes = [(f"colloc {colloc_n}{every}",
               MeasuredLayout(Layout.COLLOC, collocated_workers=colloc_n), hw),
              (f"chunked {colloc_n}{every}",
               MeasuredLayout(Layout.CHUNKED, collocated_workers=colloc_n), hw)]
    for p in range(1, workers):
        shapes.append((f"disagg {p}P+{workers - p}D{each}",
                       MeasuredLayout(Layout.DISAGG, prefill_workers=p,
                                      decode_workers=workers - p), split_hw))
    return shapes


def roofline_candidates(plan: Plan, load: Load, profile: CalibrationProfile | None = None
                        ) -> list[Candidate]:
    """Every layout on the plan's hardware; costs from the roofline, or `profile` for every
    worker (GPU presets only)."""
    w = plan.workload
    out = []
    for label, layout, hw in _shapes(plan.hardware, load.workers):
        costs = profile or RooflineCosts(plan.model, hw, w.tp, plan.kv_bytes_per_token_per_gpu,
                                         w.efficiency)
        out.append(Candidate(label, layout.layout, _cluster(plan, load, hw, layout), costs))
    return out


def calibrated_candidates(plan: Plan, load: Load, path: str, configs: Sequence[str]
                          ) -> tuple[list[Candidate], list[str]]:
    """One candidate per bench compare configuration of the steps file at `path` (its keys:
    `configs`), fitted on its own workers' steps and those of the configurations whose workers
    computed on the same threads (calibration_pool.same_job_pool, by the results beside the
    steps); notes name the pools and the configurations it lacks."""
    names = [c for c in CALIBRATED_CONFIGS if c in configs]
    if not names:
        raise ValueError(f"calibrate (--calibrate) {path}: no configuration of "
                         f"{', '.join(CALIBRATED_CONFIGS)} in this steps file (it has "
                         f"{', '.join(map(repr, configs)) or 'none'})")
    out, notes = [], []
    results = results_beside(Path(path)) or {}
    for name in names:
        pool = SEPARATOR.join(same_job_pool(results, name, names))
        source = load_calibration_source(f"{path}:{pool}")
        if not isinstance(source, StepsProfile):
            raise ValueError(f"calibrate (--calibrate) {path}:{name} holds no worker steps")
        layout = PDSERVE_CONFIGS[name]
        cluster = _cluster(plan, load, plan.hardware, layout)
        latency, note = _frontend(f"{path}:{name}", layout, cluster, source.profile)
        out.append(Candidate(name, layout.layout,
                             replace(cluster, frontend_latency_s=latency), source.profile))
        notes += [note] if note else []
        notes += [f"{name} fitted on the steps of {pool}"] if pool != name else []
    notes += [f"{path} did not run {c}: not simulated" for c in CALIBRATED_CONFIGS
              if c not in names]
    return out, notes


def _frontend(spec: str, layout: MeasuredLayout, cluster: Cluster,
              profile: CalibrationProfile) -> tuple[float, str | None]:
    """The front-end round trip of the run beside the steps (frontend_fit.py) and a note
    saying so; (0, None) without it."""
    run = calibration_run(spec, "calibrate (--calibrate)")
    if run is None:
        return 0.0, None
    latency = fit_frontend_latency(run, layout.layout, cluster, profile)
    return latency, f"front-end round trip {latency * 1e3:.1f} ms, {latency_source(run)}"


def _compare_steps(path: str) -> list[str] | None:
    """The configurations of a bench compare .steps.json at `path`; None for any other file
    (load_calibration_source reads and judges those)."""
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not is_steps_file(data) or all(
            isinstance(v, list) for v in data.values()):
        return None
    return list(data)


def _calibration(plan: Plan, load: Load, path: str) -> tuple[list[Candidate], str, list[str]]:
    """Candidates, the costs' label and notes for --calibrate `path` (module docstring)."""
    configs = _compare_steps(path)
    if configs is not None:
        candidates, notes = calibrated_candidates(plan, load, path, configs)
        return candidates, f"fitted per configuration to the worker steps of {path}", notes
    if plan.hardware.cores is not None:
        raise ValueError(f"calibrate (--calibrate) {path}: one worker's costs cannot price "
                         f"layouts that split the cores of {plan.hardware.name} differently; "
                         "give the .steps.json of a `pdserve bench compare` run of "
                         "collocated and disagg on this machine")
    source = load_calibration_source(path)
    profile = source.profile if isinstance(source, StepsProfile) else source
    if not isinstance(profile, CalibrationProfile):
        w = plan.workload
        profile = fit_bench_rows(profile.rows, context_token_seconds(
            plan.kv_bytes_per_token_per_gpu, plan.hardware, w.efficiency),
            source=profile.source, model=plan.model.name, gpu=plan.hardware.name, tp=w.tp)
    return roofline_candidates(plan, load, profile), f"calibrated: {profile.describe()}", []


# ---- running and judging ----------------------------------------------------------------------


def plan_trace(plan: Plan, load: Load) -> tuple[TraceRequest, ...]:
    """PLAN_REQUESTS requests of the plan's lengths (module docstring)."""
    w = plan.workload
    if load.rate is None:
        return tuple(TraceRequest(0.0, w.prompt_tokens, w.output_tokens)
                     for _ in range(PLAN_REQUESTS))
    spec = make_workload("fixed", load.rate, w.prompt_tokens, w.output_tokens)
    return generate_trace(spec, seed=0, num_requests=PLAN_REQUESTS)


def run_candidate(c: Candidate, trace: Sequence[TraceRequest], load: Load) -> LayoutResult:
    result = simulate(c.layout, c.cluster, c.costs, trace, clients=load.concurrency)
    summary = summary_to_dict(summarize(result.records, result.itl, load.slo))
    return LayoutResult(c.label, c.layout, summary, result.local_prefills)


def simulate_plan(plan: Plan, load: Load, calibration: str | None = None) -> Simulated:
    """Simulate every layout at `load` and judge them (module docstring)."""
    if calibration is None:
        candidates = roofline_candidates(plan, load)
        eff = plan.workload.efficiency
        costs, notes = f"roofline (MFU {eff.mfu:g}, MBU {eff.mbu:g})", []
    else:
        candidates, costs, notes = _calibration(plan, load, calibration)
    trace = plan_trace(plan, load)
    results = tuple(run_candidate(c, trace, load) for c in candidates)
    verdict, reason = judge(results)
    return Simulated(load, costs, results, verdict, reason, tuple(notes))


def _best(results: Sequence[LayoutResult], collocated: bool) -> LayoutResult | None:
    side = [r for r in results if (r.layout in COLLOCATED) == collocated]
    return max(side, key=lambda r: (r.goodput, r.summary["output_throughput"]), default=None)


def _figures(r: LayoutResult) -> str:
    s = r.summary
    return (f"{r.label}: goodput {r.goodput:.3g} req/s, median TTFT "
            f"{s['median_ttft_ms']:,.0f} ms, P99 ITL {s['p99_itl_ms'] or 0:,.0f} ms")


def judge(results: Sequence[LayoutResult]) -> tuple[Verdict, str]:
    """The verdict of the module docstring, with both sides' figures as its reason."""
    colloc, split = _best(results, True), _best(results, False)
    if colloc is None or split is None:
        raise ValueError("the simulated verdict needs a collocated and a disaggregated layout")
    both = f"{_figures(split)}; {_figures(colloc)}"
    gd, gc = split.goodput, colloc.goodput
    if gd == 0 and gc == 0:
        return Verdict.MARGINAL, f"no layout meets the SLO for any request at this load ({both})"
    if gd > (1 + MARGIN) * gc:
        return Verdict.DISAGGREGATE, f"simulated, disaggregated serves more within the SLO: {both}"
    if gc > (1 + MARGIN) * gd:
        return Verdict.COLLOCATE, f"simulated, collocated serves more within the SLO: {both}"
    return Verdict.MARGINAL, (f"simulated goodputs within {MARGIN:.0%} of each other: {both}")


def with_simulation(plan: Plan, sim: Simulated) -> Plan:
    """The plan with the simulated verdict; the rules' verdict kept as a note."""
    rules = f"without a load the rules of thumb say {plan.verdict}: {plan.reason}"
    return replace(plan, verdict=sim.verdict, reason=sim.reason,
                   notes=plan.notes + sim.notes + (rules,))


# ---- output -------------------------------------------------------------------------------------

_COLUMNS = (("goodput", "request_goodput", "{:.3f}"), ("out tok/s", "output_throughput",
                                                       "{:,.1f}"),
            ("med TTFT ms", "median_ttft_ms", "{:,.0f}"), ("P99 TTFT ms", "p99_ttft_ms",
                                                          "{:,.0f}"),
            ("med ITL ms", "median_itl_ms", "{:,.1f}"), ("P99 ITL ms", "p99_itl_ms", "{:,.1f}"))


def render_simulation(sim: Simulated) -> list[str]:
    """Table lines: the load and costs, then one row per layout."""
    width = max(len(r.label) for r in sim.results) + 2
    lines = [f"simulated      {sim.load.describe()}", f"  costs        {sim.costs}",
             "  " + f"{'layout':<{width}}" + "".join(f"{h:>13}" for h, _, _ in _COLUMNS)]
    for r in sim.results:
        cells = ["-" if r.summary[k] is None else fmt.format(r.summary[k])
                 for _, k, fmt in _COLUMNS]
        lines.append("  " + f"{r.label:<{width}}" + "".join(f"{c:>13}" for c in cells))
    return lines


def simulation_to_dict(sim: Simulated) -> dict[str, Any]:
    load = sim.load
    return {"rate": load.rate, "concurrency": load.concurrency, "requests": PLAN_REQUESTS,
            "workers": load.workers, "slo": {"ttft_ms": load.slo.ttft_ms,
                                             "tpot_ms": load.slo.tpot_ms},
            "costs": sim.costs,
            "layouts": [{"label": r.label, "layout": str(r.layout),
                         "local_prefills": r.local_prefills, **r.summary}
                        for r in sim.results]}
