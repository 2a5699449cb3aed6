"""`pdserve simulate`: predicted TTFT/ITL/TPOT/E2E percentiles of one trace on a cluster laid
out disaggregated (P prefill + D decode workers) and collocated (C workers, with and without
chunked prefill). `add_simulate_parser` registers it on a subparsers object; its handler
returns the exit status (0, or 2 after `pdserve: error: ...` on bad input).

Measured runs: --calibrate takes a worker steps file (calibration_source.py), --trace a bench
serve/compare results file (measured_run.py), and --compare-measured RESULTS[:CONFIG] simulates
that run's requests on its own layout and prints the simulated median and P99 TTFT and ITL,
goodput and output throughput beside the measured ones, each against its tolerance
(measured_compare.py, which also says how the layout is found). When the calibration run and
the measured one both carry bench compare's speed reference, the fitted costs are first scaled
to the measured run's speed (speed_scale.py; --speed-reference ignore: not scaled;
--speed-reference steps, a diagnostic: priced at the measured run's own steps' speed, window
by window, speed_timeline.py).

Admission (admission.py): --max-inflight-per-worker, --max-queue and --max-queue-wait-s model
the router's back-pressure, as its flags of the same names (one declaration serves both,
cli_args.add_admission_flags); any of them turns it on, the others taking the router's
defaults. A --compare-measured run of a pdserve configuration (bench
compare's, measured_compare.pdserve_layout) was served by a router with admission, so it is
modelled there even without them; any other run, and a trace without one, is simulated without
admission (every request served) unless a flag is given.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.cli_args import add_admission_flags
from pdserve.planner.cost import DEFAULT_MBU, DEFAULT_MFU, Efficiency
from pdserve.planner.hardware import HARDWARE, Hardware, get_hardware
from pdserve.planner.kv_math import DTYPE_BYTES, check_tp, dtype_bytes, kv_bytes_per_token_per_rank
from pdserve.planner.model_shape import PRESETS, ModelShape, load_model_shape
from pdserve.planner.plan import (
    DEFAULT_MAX_DECODE_BATCH,
    MEMORY_UTILIZATION,
    PREFILL_BATCH_TOKENS,
    kv_room_tokens,
)
from pdserve.planner.simulate.admission import DEFAULT_MAX_QUEUE_WAIT_S, Admission
from pdserve.planner.simulate.calibration import (
    BenchRows,
    CalibrationProfile,
    RooflineCosts,
    StepCosts,
    context_token_seconds,
    fit_bench_rows,
)
from pdserve.planner.simulate.calibration_source import (
    FLAG,
    StepsProfile,
    load_calibration_source,
)
from pdserve.planner.simulate.cluster import (
    DEFAULT_CHUNK_TOKENS,
    Cluster,
    Layout,
    RoutePolicy,
    check_fits,
)
from pdserve.planner.simulate.events import SimResult, simulate
from pdserve.planner.simulate.frontend_fit import (
    calibration_run,
    fit_frontend_latency,
    latency_source,
)
from pdserve.planner.simulate.measured_compare import (
    Comparison,
    MeasuredLayout,
    compare,
    comparison_json,
    measured_layout,
    pdserve_layout,
    render_comparison,
    split_local_prefills,
    split_paths,
)
from pdserve.planner.simulate.measured_run import MeasuredRun, load_measured_run, read_trace_file
from pdserve.planner.simulate.metrics import Slo, Summary, summarize, summary_to_dict
from pdserve.planner.simulate.speed_scale import (
    SPEED_REFERENCE_MODES,
    SpeedScale,
    decode_factor,
    parse_cost_scale,
    scale_costs,
    scale_profile,
    speed_factor,
)
from pdserve.planner.simulate.speed_timeline import WINDOW_S, SpeedTimeline, build_timeline
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.step_check import step_ratios, steps_beside
from pdserve.planner.simulate.step_fit import DECODE_TIMES
from pdserve.planner.simulate.trace import WORKLOADS, TraceRequest, generate_trace, make_workload

DEFAULT_SLO = Slo(ttft_ms=2000.0, tpot_ms=100.0)  # the bench commands' usual bounds

_DESCRIPTION = (
    "Simulate serving a request trace (a workload preset with Poisson arrivals from a fixed "
    "seed, or a JSONL file) on a disaggregated cluster and on collocated workers with and "
    "without chunked prefill, with step costs from the same roofline as `pdserve plan` or from "
    "a calibration measured on a real machine. Prints vLLM `bench serve` metrics: TTFT, TPOT, "
    "ITL and E2E latency (mean, median, P90, P99), throughput and goodput."
)
_EPILOG = (
    "Workloads: chat (prompt U[128,1024], output U[128,512]); rag (prompt U[3600,4400], "
    "output U[450,550]); mixed (chat at 90% of the rate plus bursts of 6000-8000-token "
    "prompts every 10 s); fixed (--prompt-tokens, --output-tokens). --calibrate takes a "
    "`pdserve bench engine --json` results file or a `bench compare` .steps.json (fitted) or a "
    "calibration profile JSON. "
    "Example: pdserve simulate --model llama-3.1-70b --gpu H100 --tp 8 --prefill 4 --decode 4 "
    "--workload rag --rate 2. Predicting a measured run: pdserve simulate --model smollm2-135m "
    "--gpu cpu --calibrate A.steps.json:disagg --compare-measured B.json:disagg"
)


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `simulate` on `subparsers` with func = the handler."""
    p = subparsers.add_parser("simulate", help="predict latency percentiles of disaggregated "
                                               "vs collocated serving",
                              description=_DESCRIPTION, epilog=_EPILOG)
    _add_model_args(p)
    _add_cluster_args(p)
    _add_admission_args(p)
    _add_trace_args(p)
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="goodput counts requests with TTFT at most this (default: the bound "
                        f"the --compare-measured run counted with, else {DEFAULT_SLO.ttft_ms:g})")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="goodput counts requests with TPOT at most this (default: the bound "
                        f"the --compare-measured run counted with, else {DEFAULT_SLO.tpot_ms:g})")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="the longest step a decode worker's paced local prompts take beside "
                        "its streams, spending what cheaper steps left of the TPOT target "
                        "(pdserve up --slo-itl-ms; default: the --compare-measured run's "
                        "cluster's, else the TPOT target)")
    p.add_argument("--compare-measured", default=None, metavar="RESULTS[:CONFIG]",
                   help="a `bench serve` or `bench compare` --out file: simulate its requests "
                        "(unless --trace/--workload) on its layout (from a bench compare "
                        "configuration name, else --layouts) and print the simulated median "
                        "and P99 TTFT and ITL, goodput (with the bounds the run counted) and "
                        "output throughput beside the measured ones")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    p.set_defaults(func=run_simulate)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json path (default: the "
                        "calibration profile's model)")
    p.add_argument("--gpu", default=None,
                   help=f"device preset: {', '.join(h.upper() for h in HARDWARE)} (default: "
                        "the calibration profile's, else H100)")
    p.add_argument("--tp", type=int, default=None,
                   help="GPUs per worker (default: the profile's, else 1)")
    p.add_argument("--kv-dtype", default="bf16",
                   help=f"KV format: {', '.join(DTYPE_BYTES)} (default: %(default)s)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="roofline MFU "
                   "(default: %(default)s)")
    p.add_argument("--mbu", type=float, default=DEFAULT_MBU, help="roofline MBU "
                   "(default: %(default)s)")
    p.add_argument("--calibrate", default=None, metavar="FILE[:CONFIG]",
                   help="step costs fitted to a `bench compare` .steps.json (:CONFIG picks one "
                        "configuration; :A+B fits A's steps and B's, priced at A's speed by "
                        "their speed references, where both computed on the same threads; "
                        "else every worker of every one is pooled as measured) or a "
                        "`pdserve bench engine --json` file, or read from a profile JSON")
    p.add_argument("--step-time", choices=DECODE_TIMES, default="period",
                   help="decode step time in a steps file: period (start to the worker's next "
                        "start, which a client's ITL sees) or duration (the engine step "
                        "alone) (default: %(default)s)")
    p.add_argument("--decode-context-us", type=float, default=None, metavar="US",
                   help="with --calibrate steps: hold the decode cost per context token at "
                        "this many microseconds and fit the rest (a calibration run whose "
                        "long contexts all come in large batches cannot tell that cost from "
                        "the per-stream one; measure it apart)")
    p.add_argument("--speed-reference", choices=SPEED_REFERENCE_MODES, default="scale",
                   help="with --calibrate FILE.steps.json:CONFIG and --compare-measured: scale "
                        "the fitted costs by the measured run's speed reference over the "
                        "calibration run's (the fixed engine jobs bench compare times around "
                        "each run), when both have one: scale, every cost by the prefill job; "
                        "split, the prompt costs by the prefill job and the decode costs by "
                        "the decode job; ignore: price at the calibration run's speed; "
                        "steps, a diagnostic and not a prediction: price each step at the "
                        "speed the measured run's own steps ran at in its window "
                        "(--speed-window; from the .steps.json beside it): what is still "
                        "missed then is the model's, not the machine's drift (default: "
                        "%(default)s)")
    p.add_argument("--speed-window", type=float, default=None, metavar="S",
                   help=f"with --speed-reference steps: the windows the measured run's own "
                        f"speed is read in, in seconds (longer than the run: one factor per "
                        f"kind of step for the whole run; default: {WINDOW_S:g})")
    p.add_argument("--scale-costs", default=None, metavar="KIND=F[,KIND=F]",
                   help="with --calibrate: multiply the fitted prompt costs (prefill=F: "
                        "overhead, per token, per attention pair) or decode costs (decode=F: "
                        "overhead, per stream, per context token) by F, after any speed "
                        "reference: what the layouts give on a machine that much slower or "
                        "faster at that kind of step (e.g. prefill=1.1,decode=0.9)")
    p.add_argument("--write-profile", default=None, metavar="FILE",
                   help="with --calibrate: write the fitted profile JSON here")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    measured = "; a measured pdserve configuration's with --compare-measured"
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default: 1)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default: 1)")
    p.add_argument("--collocated", type=int, default=None,
                   help=f"collocated workers (default: prefill + decode, the same GPUs{measured})")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"prefill tokens per chunked step (default: {DEFAULT_CHUNK_TOKENS}"
                        f"{measured})")
    p.add_argument("--layouts", default=None,
                   help="which layouts to run, comma-separated (default: disagg,colloc,chunked"
                        "; the measured one with --compare-measured)")
    p.add_argument("--split", choices=list(SplitRule), default=None,
                   help="how the disagg layout routes prompts, as pdserve's router: measured "
                        "(its default: each prompt where its first token comes soonest, a "
                        "local prefill paced beside the decode worker's streams to the TPOT "
                        "target, --slo-tpot-ms), local (every prompt on its decode worker) or "
                        "remote (every prompt on a prefill worker) (default: measured; a "
                        "measured pdserve configuration's with --compare-measured)")
    p.add_argument("--policy", choices=list(RoutePolicy), default=RoutePolicy.LEAST_LOADED,
                   help="how the router picks a worker of a pool, as its --policy: "
                        "least_loaded (fewest requests), or prefix (the worker most likely "
                        "to hold the prompt's shared prefix, then the least loaded) "
                        "(default: %(default)s)")
    p.add_argument("--frontend-latency-ms", type=float, default=None,
                   help="the round trip between a client and its worker (router and HTTP, "
                        "both ways), added to TTFT and E2E and to a closed loop's next send "
                        "(default: from the run beside a --calibrate FILE.steps.json:CONFIG, "
                        "its FILE.json: its idle probes, else fitted to its 10th-percentile "
                        "TTFT; else 0)")
    p.add_argument("--link-gbps", type=float, default=100.0,
                   help="KV link per GPU in Gb/s (default: %(default)s)")
    p.add_argument("--link-fixed-ms", type=float, default=0.0,
                   help="what a KV hand-over costs whatever its bytes, in ms, added to the "
                        "wire time of every split request's KV and to the link the split "
                        "decision prices (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"running requests per worker (default: {DEFAULT_MAX_DECODE_BATCH}"
                        f"{measured})")
    p.add_argument("--prefill-budget", type=int, default=PREFILL_BATCH_TOKENS,
                   help="prompt tokens per prefill step (default: %(default)s)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV tokens per worker (default: what fits beside the weights in "
                        f"{MEMORY_UTILIZATION * 100:.0f}%% of device memory{measured})")


def _add_admission_args(p: argparse.ArgumentParser) -> None:
    """The router's admission flags (cli_args.add_admission_flags); each left out takes the
    router's default, measured from the simulated completions as the router measures its own."""
    add_admission_flags(
        p, title="admission (the router's back-pressure; any of these turns it on, the others "
                 "taking the router's defaults; on by default with --compare-measured of a "
                 "pdserve configuration, else off: every request served)",
        wait_s=None,
        inflight_default="the router's, measured: --max-batch, and once requests completed, "
                         "at most the number of average requests whose KV fits a worker",
        queue_default="the router's, measured: completions per second times "
                      "--max-queue-wait-s",
        wait_default=f"the router's, {DEFAULT_MAX_QUEUE_WAIT_S:g}")


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=None,
                   help=f"preset: {', '.join(WORKLOADS)} (default: chat)")
    p.add_argument("--trace", default=None, metavar="FILE[:CONFIG]",
                   help='JSONL of {"arrival_s", "prompt_tokens", "output_tokens"} (and '
                        'optionally "prefix_id", "prefix_tokens": a shared prefix), or a bench '
                        "serve/compare results file (its requests; :CONFIG picks one "
                        "configuration), instead of a preset")
    p.add_argument("--rate", type=float, default=2.0, help="req/s (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=None,
                   help="arrivals before this many seconds (default: 600)")
    p.add_argument("--num-requests", type=int, default=None, help="instead of --duration-s")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="with --workload fixed")
    p.add_argument("--output-tokens", type=int, default=None, help="with --workload fixed")


@dataclass(frozen=True)
class Setup:
    """Everything a run needs, resolved and validated from the arguments."""

    shape: ModelShape
    hardware: Hardware
    tp: int
    efficiency: Efficiency
    profile: CalibrationProfile | None  # None: roofline costs
    cluster: Cluster
    trace: tuple[TraceRequest, ...]
    trace_label: str
    layouts: tuple[Layout, ...]
    slo: Slo
    measured: MeasuredRun | None = None
    frontend_source: str = "none"  # where cluster.frontend_latency_s comes from
    measured_spec: str | None = None  # --compare-measured as given
    speed_scale: SpeedScale | None = None  # the profile's factors to the measured run's speed
    # --speed-reference steps: the measured run's own speed by window; None: not priced so
    speed_timeline: SpeedTimeline | None = None

    @property
    def clients(self) -> int | None:
        """The measured run's closed-loop clients when its own requests are replayed."""
        return self.measured.clients if self._replayed else None

    @property
    def warm_up(self) -> tuple[TraceRequest, ...]:
        """The measured run's warm-up requests when its own requests are replayed."""
        return self.measured.warm_up if self._replayed else ()

    @property
    def _replayed(self) -> bool:
        return self.measured is not None and self.trace is self.measured.trace

    @property
    def costs(self) -> StepCosts:
        if self.profile is not None:
            return self.profile
        return RooflineCosts(self.shape, self.hardware, self.tp,
                             self.cluster.kv_bytes_per_token_rank, self.efficiency)


def run_simulate(args: argparse.Namespace) -> int:
    """Print the comparison (table or JSON). Bad input raises ValueError, which
    `pdserve.cli.main` reports as `pdserve: error: ...` with exit status 2."""
    setup = resolve(args)
    costs = setup.costs
    results = [(r, summarize(r.records, r.itl, setup.slo))
               for r in (simulate(layout, setup.cluster, costs, setup.trace,
                                  clients=setup.clients, warm_up=setup.warm_up,
                                  speed=setup.speed_timeline)
                         for layout in setup.layouts)]
    against = _against_measured(setup, results)
    if args.json:
        out = to_json(setup, results)
        if against is not None:
            out["measured"] = comparison_json(against)
        print(json.dumps(out, indent=2))
    else:
        text = render(setup, results)
        print(text if against is None else f"{text}\n\n{render_comparison(against)}")
    return 0


def _against_measured(setup: Setup, results: list[tuple[SimResult, Summary]]
                      ) -> Comparison | None:
    """The measured run beside its (only) simulated layout."""
    if setup.measured is None:
        return None
    result, summary = results[0]
    return compare(setup.measured, layout_label(result.layout, setup.cluster),
                   summary_to_dict(summary), split_local_prefills(result),
                   _held_out_ratios(setup), setup.speed_scale,
                   split_paths(setup.measured, result), result.itl, setup.speed_timeline)


def _held_out_ratios(setup: Setup) -> dict[str, dict[str, Any]] | None:
    """The measured run's own steps priced by the calibration profile (step_check.py)."""
    if setup.profile is None or setup.measured_spec is None:
        return None
    steps = steps_beside(setup.measured_spec, "compare_measured (--compare-measured)")
    return step_ratios(setup.profile, steps) if steps else None


def resolve(args: argparse.Namespace) -> Setup:
    """Validate in order: calibration file, model and device, costs, measured run, cluster,
    trace."""
    source = load_calibration_source(args.calibrate, args.step_time, _held_context(args)) \
        if args.calibrate else None
    profile = source.profile if isinstance(source, StepsProfile) else (
        source if isinstance(source, CalibrationProfile) else None)
    model = args.model or (profile.model if profile else None)
    if model is None:
        raise ValueError("model (--model) is required (a calibration profile may name it)")
    gpu = args.gpu or (profile.gpu if profile else None)
    if gpu is None and isinstance(source, BenchRows | StepsProfile):
        raise ValueError("gpu (--gpu) is required with bench rows or worker steps: the device "
                         "they were measured on (e.g. cpu)")
    tp = args.tp if args.tp is not None else (profile.tp if profile else 1)
    check_tp(tp)
    eff = Efficiency(mfu=args.mfu, mbu=args.mbu)
    hw, shape = get_hardware(gpu or "H100"), load_model_shape(model)
    dtype_bytes(args.kv_dtype, "kv_dtype (--kv-dtype)")
    kv_rank = kv_bytes_per_token_per_rank(shape, args.kv_dtype, tp)
    if isinstance(source, BenchRows):
        profile = fit_bench_rows(source.rows, context_token_seconds(kv_rank, hw, eff),
                                 source=source.source, model=model, gpu=gpu, tp=tp)
    elif isinstance(source, StepsProfile):
        profile = replace(source.profile, model=model, gpu=gpu, tp=tp)
    if args.write_profile:
        _write_profile(profile, args.write_profile)
    measured = (load_measured_run(args.compare_measured, "compare_measured (--compare-measured)")
                if args.compare_measured else None)
    layouts = _layouts(args.layouts)
    how = measured_layout(measured, layouts) if measured else None
    slo = _slo(args, measured)
    cluster = replace(_cluster(args, shape, hw, tp, kv_rank, how or _FLAGS_ONLY,
                               slo.tpot_ms / 1e3), admission=_admission(args, measured),
                      itl_target_s=_itl_target(args, measured),
                      ttft_target_s=None if slo.ttft_ms is None else slo.ttft_ms / 1e3)
    calibration = calibration_run(args.calibrate, FLAG) if args.calibrate and profile else None
    latency, latency_label = _frontend_latency(args, calibration, profile, shape, hw, tp,
                                               kv_rank)  # at the calibration run's own speed
    cluster = replace(cluster, frontend_latency_s=latency)
    scale = _speed_scale(args, calibration, measured)  # None without a calibration run
    if scale is not None and profile is not None:  # after the front end's fit, at A's speed
        profile = scale_profile(profile, scale.prefill, args.decode_context_us is not None,
                                scale.decode if scale.split else None)
    profile = _scaled_costs(args, profile)
    trace, label = _trace(args, measured)
    check_fits(trace, cluster)
    return Setup(shape, hw, tp, eff, profile, cluster, trace, label,
                 (how.layout,) if how else layouts or tuple(Layout), slo, measured,
                 latency_label, args.compare_measured, scale,
                 _timeline(args, profile, measured, trace))


def _timeline(args: argparse.Namespace, profile: CalibrationProfile | None,
              measured: MeasuredRun | None, trace: tuple[TraceRequest, ...]
              ) -> SpeedTimeline | None:
    """--speed-reference steps: the measured run's own speed by window (speed_timeline.py);
    ValueError where it cannot be read: no fitted profile, no measured run replayed, no steps
    beside it, or figures that are medians over rounds the steps do not all come from."""
    if args.speed_reference != "steps":
        if args.speed_window is not None:
            raise ValueError("--speed-window sets the windows of --speed-reference steps; "
                             f"here the speed reference is {args.speed_reference!r}")
        return None
    flag = "compare_measured (--compare-measured)"
    if profile is None or measured is None or trace is not measured.trace:
        raise ValueError("--speed-reference steps prices a --compare-measured run's own "
                         "requests at its own steps' speed: give --calibrate and "
                         "--compare-measured, without --trace")
    if measured.rounds > 1 or measured.run_start_s is None:
        why = f"has {measured.rounds} rounds" if measured.rounds > 1 else "has no run_window"
        raise ValueError(f"--speed-reference steps needs one round's run with its run_window "
                         f"(bench compare --out, without --repeats): {measured.label} {why}")
    steps = steps_beside(args.compare_measured, flag)
    if not steps:
        raise ValueError(f"--speed-reference steps reads the steps beside {measured.label} "
                         "(bench compare writes X.steps.json beside X.json): none found")
    window = WINDOW_S if args.speed_window is None else args.speed_window
    return build_timeline(profile, steps, measured.run_start_s, window)


def _scaled_costs(args: argparse.Namespace, profile: CalibrationProfile | None
                  ) -> CalibrationProfile | None:
    """`profile` times --scale-costs (speed_scale.scale_costs); ValueError without one."""
    if args.scale_costs is None:
        return profile
    factors = parse_cost_scale(args.scale_costs)
    if profile is None:
        raise ValueError("--scale-costs scales fitted costs: give --calibrate")
    return scale_costs(profile, factors)


def _speed_scale(args: argparse.Namespace, calibration: MeasuredRun | None,
                 measured: MeasuredRun | None) -> SpeedScale | None:
    """The measured run's times for the speed reference's jobs (every round's, as its figures)
    over the calibration run's (its steps' round; speed_scale.py); None with --speed-reference
    ignore or where a run has no reference. ValueError for split without the decode job."""
    if args.speed_reference in ("ignore", "steps") or calibration is None or measured is None:
        return None
    ref, other = calibration.speed_reference, measured.rounds_reference
    if ref is None or other is None:
        return None
    scale = SpeedScale(speed_factor(ref, other), decode_factor(ref, other),
                       args.speed_reference == "split")
    if scale.split and scale.decode is None:
        raise ValueError("--speed-reference split needs the decode job timed around both runs "
                         "(results of a bench compare that times it); use scale")
    return scale


_OWN_LIMITS = ("prefill", "decode", "collocated", "chunk", "max_batch", "kv_capacity_tokens",
               "split")  # cluster flags a calibration run does not take: it ran with its own


def _frontend_latency(args: argparse.Namespace, run: MeasuredRun | None,
                      profile: CalibrationProfile | None, shape: ModelShape, hw: Hardware,
                      tp: int, kv_rank: int) -> tuple[float, str]:
    """(seconds, where they come from): --frontend-latency-ms, else fitted to the calibration
    run beside the steps (`run`, frontend_fit.py) when it is a pdserve configuration, else 0."""
    ms = args.frontend_latency_ms
    if ms is not None:
        if not 0 <= ms < math.inf:
            raise ValueError(f"--frontend-latency-ms must be a number of ms >= 0, got {ms!r}")
        return ms / 1e3, "--frontend-latency-ms"
    how = None if run is None or profile is None else pdserve_layout(run)
    if how is None:
        return 0.0, "none"
    own = argparse.Namespace(**{**vars(args), **dict.fromkeys(_OWN_LIMITS)})
    tpot_s = (run.slo_tpot_ms or DEFAULT_SLO.tpot_ms) / 1e3
    latency = fit_frontend_latency(run, how.layout,
                                   _cluster(own, shape, hw, tp, kv_rank, how, tpot_s), profile)
    return latency, latency_source(run)


def _held_context(args: argparse.Namespace) -> float | None:
    """--decode-context-us in seconds; ValueError unless a number >= 0 beside --calibrate."""
    us = args.decode_context_us
    if us is None:
        return None
    if not 0 <= us < math.inf:
        raise ValueError(f"--decode-context-us must be a number of microseconds >= 0, got {us!r}")
    return us / 1e6


def _slo(args: argparse.Namespace, measured: MeasuredRun | None) -> Slo:
    """The goodput bounds: each flag given, else the measured run's, else the default. A flag
    that differs from the bound the measured run counted with is refused: the two goodputs
    would not compare."""
    bounds = []
    for name in ("ttft_ms", "tpot_ms"):
        flag = getattr(args, f"slo_{name}")
        recorded = getattr(measured, f"slo_{name}") if measured else None
        if flag is not None and recorded is not None and flag != recorded:
            raise ValueError(f"--slo-{name.replace('_', '-')} {flag:g} differs from the "
                             f"{recorded:g} ms that {measured.label} counted its goodput with; "
                             f"the goodputs would not compare: leave the flag out")
        bounds.append(flag if flag is not None else
                      recorded if recorded is not None else getattr(DEFAULT_SLO, name))
    return Slo(*bounds)


def _itl_target(args: argparse.Namespace, measured: MeasuredRun | None) -> float | None:
    """The paced steps' ceiling in seconds: --slo-itl-ms, else the one the measured run's
    cluster paced to, else none (steps within the TPOT target)."""
    ms = args.slo_itl_ms if args.slo_itl_ms is not None else \
        measured.slo_itl_ms if measured else None
    return None if ms is None else ms / 1e3


def _admission(args: argparse.Namespace, measured: MeasuredRun | None) -> Admission | None:
    """The router's admission from the flags (module docstring); None: not modelled.
    ValueError for a bad value, naming the flag."""
    flags = (args.max_inflight_per_worker, args.max_queue, args.max_queue_wait_s)
    pdserve_run = measured is not None and pdserve_layout(measured) is not None
    if all(flag is None for flag in flags) and not pdserve_run:
        return None
    wait = DEFAULT_MAX_QUEUE_WAIT_S if args.max_queue_wait_s is None else args.max_queue_wait_s
    if not math.isfinite(wait):  # the router's flag takes finite seconds only
        raise ValueError(f"max_queue_wait_s (--max-queue-wait-s) must be a number of seconds "
                         f"> 0, got {wait!r}")
    return Admission(max_inflight_per_worker=args.max_inflight_per_worker,
                     max_queue=args.max_queue, max_queue_wait_s=wait)


def _write_profile(profile: CalibrationProfile | None, path: str) -> None:
    if profile is None:
        raise ValueError("--write-profile needs --calibrate")
    try:
        Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    except OSError as e:
        raise ValueError(f"write_profile (--write-profile) {path!r}: {e.strerror}") from e


_FLAGS_ONLY = MeasuredLayout(Layout.DISAGG)  # no measured run: every limit from flags/defaults


def _first(*values: int | None) -> int | None:
    """The first value that is not None (flag, then measured configuration, then default)."""
    return next((v for v in values if v is not None), None)


def _cluster(args: argparse.Namespace, shape: ModelShape, hw: Hardware, tp: int,
             kv_rank: int, how: MeasuredLayout, tpot_target_s: float) -> Cluster:
    capacity = args.kv_capacity_tokens
    if capacity is None and how.kv_cache_bytes is not None:
        capacity = how.kv_cache_bytes // kv_rank
    if capacity is None:
        capacity = kv_room_tokens(shape, hw, tp, kv_rank)
    prefill = _first(args.prefill, how.prefill_workers, 1)
    decode = _first(args.decode, how.decode_workers, 1)
    return Cluster(kv_capacity_tokens=capacity, kv_bytes_per_token_rank=kv_rank,
                   link_gbps=args.link_gbps, link_fixed_s=args.link_fixed_ms / 1e3,
                   prefill_workers=prefill, decode_workers=decode,
                   collocated_workers=_first(args.collocated, how.collocated_workers,
                                             prefill + decode),
                   max_batch=_first(args.max_batch, how.max_batch, DEFAULT_MAX_DECODE_BATCH),
                   prefill_budget_tokens=args.prefill_budget,
                   chunk_tokens=_first(args.chunk, how.chunk_tokens, DEFAULT_CHUNK_TOKENS),
                   split=args.split or how.split or SplitRule.MEASURED,
                   tpot_target_s=tpot_target_s, policy=RoutePolicy(args.policy))


def _trace(args: argparse.Namespace, measured: MeasuredRun | None
           ) -> tuple[tuple[TraceRequest, ...], str]:
    if args.trace is not None:
        if args.workload is not None:
            raise ValueError("give --trace or --workload, not both")
        return read_trace_file(args.trace)
    if measured is not None and args.workload is None:
        return measured.trace, f"requests of {measured.label}"
    spec = make_workload(args.workload or "chat", args.rate, args.prompt_tokens,
                         args.output_tokens)
    duration = args.duration_s
    if duration is None and args.num_requests is None:
        duration = 600.0
    trace = generate_trace(spec, args.seed, duration, args.num_requests)
    return trace, f"{spec.name}, {args.rate:g} req/s Poisson (seed {args.seed})"


def _layouts(text: str | None) -> tuple[Layout, ...] | None:
    """The layouts --layouts names, in order without repeats; None when not given."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [str(x) for x in Layout]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"layouts (--layouts) must list some of {', '.join(known)}, "
                         f"got {text!r}")
    return tuple(dict.fromkeys(Layout(n) for n in names))


# ---- output -------------------------------------------------------------------------------------


def layout_label(layout: Layout, cluster: Cluster) -> str:
    if layout is Layout.DISAGG:
        return f"disagg {cluster.prefill_workers}P+{cluster.decode_workers}D ({cluster.split})"
    if layout is Layout.COLLOC:
        return f"colloc {cluster.collocated_workers}"
    return f"chunked {cluster.collocated_workers} ({cluster.chunk_tokens})"


def _costs_label(setup: Setup) -> str:
    if setup.profile is not None:
        return (f"calibrated ({setup.profile.source or 'profile'})\n"
                f"    {setup.profile.describe()}")
    return f"roofline (MFU {setup.efficiency.mfu:g}, MBU {setup.efficiency.mbu:g})"


def _costs_json(setup: Setup) -> dict[str, Any]:
    if setup.profile is not None:
        return {"kind": "calibrated", **setup.profile.to_dict()}
    return {"kind": "roofline", "mfu": setup.efficiency.mfu, "mbu": setup.efficiency.mbu}


def to_json(setup: Setup, results: list[tuple[SimResult, Summary]]) -> dict[str, Any]:
    c = setup.cluster
    return {
        "model": setup.shape.name, "gpu": setup.hardware.name, "tp": setup.tp,
        "link_gbps": c.link_gbps, "trace": setup.trace_label, "requests": len(setup.trace),
        "costs": _costs_json(setup), "kv_capacity_tokens": c.kv_capacity_tokens,
        "max_batch": c.max_batch, "policy": str(c.policy),
        "prefill_budget_tokens": c.prefill_budget_tokens,
        "frontend_latency_ms": c.frontend_latency_s * 1e3,
        "frontend_latency_source": setup.frontend_source,
        "admission": None if c.admission is None else asdict(c.admission),
        "slo": {"ttft_ms": setup.slo.ttft_ms, "tpot_ms": setup.slo.tpot_ms},
        "itl_target_ms": None if c.itl_target_s is None else c.itl_target_s * 1e3,
        "results": [{"layout": str(r.layout), "label": layout_label(r.layout, c),
                     "busy": r.busy, "local_prefills": r.local_prefills,
                     **summary_to_dict(s)} for r, s in results],
    }


_ROWS = [("completed", "completed", "{:,}"), ("failed", "failed (refused)", "{:,}"),
         ("request_throughput", "requests/s", "{:.3f}"),
         ("output_throughput", "output tokens/s", "{:,.1f}"),
         ("request_goodput", "goodput (req/s)", "{:.3f}"), ("good_requests", "good requests",
                                                            "{:,}")]
_ROWS += [(f"{stat}_{metric}_ms", f"{stat} {metric.upper()} (ms)", "{:,.2f}")
          for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90",
                                                                      "p99")]


def _admission_label(admission: Admission | None) -> str:
    if admission is None:
        return "none (every request served)"
    return f"as the router's, {admission.describe()}"


def render(setup: Setup, results: list[tuple[SimResult, Summary]]) -> str:
    """Header lines, then one row per metric and one column per layout."""
    c, hw = setup.cluster, setup.hardware
    lines = [f"pdserve simulate: {setup.shape.name} on {hw.name} x tp {setup.tp} per worker; "
             f"KV link {c.link_gbps:g} Gb/s per GPU",
             f"  trace: {setup.trace_label}, {len(setup.trace):,} requests",
             f"  step costs: {_costs_label(setup)}",
             f"  per worker: KV {c.kv_capacity_tokens:,} tokens; max batch {c.max_batch}; "
             f"prefill budget {c.prefill_budget_tokens:,} tokens",
             f"  admission: {_admission_label(c.admission)}",
             f"  front-end round trip: {c.frontend_latency_s * 1e3:.1f} ms "
             f"({setup.frontend_source})",
             f"  SLO: TTFT <= {setup.slo.ttft_ms:g} ms, TPOT <= {setup.slo.tpot_ms:g} ms", ""]
    heads = [layout_label(r.layout, c) for r, _ in results]
    width = max(18, *(len(h) + 2 for h in heads))
    lines.append(f"{'metric':<22}" + "".join(f"{h:>{width}}" for h in heads))
    dicts = [summary_to_dict(s) for _, s in results]
    for key, label, fmt in _ROWS:
        cells = ["-" if d[key] is None else fmt.format(d[key]) for d in dicts]
        lines.append(f"{label:<22}" + "".join(f"{x:>{width}}" for x in cells))
    busy = ["/".join(f"{k} {v:.0%}" for k, v in r.busy.items()) for r, _ in results]
    lines.append(f"{'busy':<22}" + "".join(f"{x:>{width}}" for x in busy))
    return "\n".join(lines)
