"""`pdserve bench simulator`: does `pdserve simulate` predict runs it was not calibrated on?

One calibration workload and several held-out ones are each measured with `pdserve bench
compare` (every configuration on the same cores, the same trace), into DIR/<workload>.json and
its .steps.json. Then, per configuration C and held-out workload W, `pdserve simulate
--calibrate DIR/<calibration>.steps.json:C --compare-measured DIR/<W>.json:C --json` fits C's
step costs on the calibration run alone and simulates W's recorded requests on C's layout. C's
steps are fitted together with those of every other configuration of the calibration run whose
workers computed on as many threads, with the same speed reference job (`--calibrate
...steps.json:C+D`, calibration_pool.py: collocated and collocated-chunked run the same engine
on every core, and chunked serving alone leaves few decode-only steps to fit); `--own-steps`
fits each on its own. The
table holds each figure simulated against measured, with its error and whether it is within the
simulator's tolerance (25%; 35% for the P99 ITL), and per workload whether the configuration
the simulation ranks best by goodput is the one measured best (simulator_ranking.py: the same
one, one measured within 5% of it, or one the measurement cannot tell apart from it: the line
pairs the measured best with every other configuration request by request over every round,
how many requests met the SLO under the best only and under the other only, and the exact
McNemar p of that split; where no configuration met the SLO the line says there was nothing to
rank).
Goodput counts requests within a 2 s TTFT and a 100 ms TPOT (`SLO_*`; 100 ms is also what
`pdserve up` paces to). A split configuration's row also has its local prefills, measured (the
router's, from the results' `split_decisions`) / simulated, informational: no tolerance ("-"
where a results file predates them or the configuration does not split), with how many requests
took the same path in both where the results hold the router's route per request, and its steps
priced by the calibration: per kind of step, the median of measured / priced (`pdserve
simulate`'s step_check.py; near 1: the costs hold there, and a miss is the scheduling's). Each
calibration is scaled to the held-out run's speed by the fixed engine job bench compare times
before and after every run (`pdserve simulate --speed-reference`, speed_scale.py; the row shows
the factor, and the decode job's beside it where both runs timed it): the machine's speed
drifts between runs by more than the model misses. `--speed-reference split` prices the decode
costs by the decode job's factor instead, `ignore` every run at the calibration run's speed;
`steps` is a diagnostic: each step priced at the speed the held-out run's own steps ran at in
its window (speed_timeline.py), so that what is still out is the model's and not the
machine's drift within the run.
With `--repeats N` each figure is the median of its N rounds, and a figure whose rounds moved
by more than its tolerance (measured_spread.py, `bench simulator-repeat`'s rule for two runs) is
marked ~, noise: the measurement does not pin it down to the tolerance a simulation is held
to (a P99 ITL whose run has its stalls' ITLs near 1% of the samples jumps between the stalls
and the steady steps). The line under the table counts the figures outside their tolerance,
and of those the noise. Beside the figures, `itl>p99` is the share of the simulated ITLs longer
than the measured P99 ITL (measured_compare.py: 1% where they agree; a P99 ITL miss with
0.5-2% there is the stalls' cliff, not the model's), and the count line says how many of the
P99 ITL misses are such.

`--configs` may add `elastic` (`pdserve up --elastic`): its pair on one machine merges at rest,
the prefill worker's cores lent to the decode worker, and a run in which it stayed merged is
simulated as that one engine prefilling every prompt in chunks paced beside its streams
(measured_compare.py). A run in which a role flipped, the cores were taken back, or the
prefill worker computed, in the calibration run or the held-out one, is listed as not
simulated, with why, rather than simulated as something it was not, and fails the check.
`--slo-itl-ms` gives the runs' paced steps a ceiling above the TPOT target (bench compare's
flag: the elastic and disagg workers'), which the simulation reads from the results.

The decode cost per context token is held, by default, at what `pdserve bench decode-context`
measures on each configuration's threads per worker (bench/simulator_context.py: a serving
run's fit cannot tell it from the per-stream cost), and the other costs are fitted around it;
`--decode-context fitted` fits it too, `--decode-context-us` holds one value for all.

`--load X` multiplies every open-loop workload's request rate by X (mixed: its chat stream,
whose long bursts keep their period; chat, a closed loop of 16 clients, sends as fast as the
server answers at any load): the rates are sized for the 2-core AVX-512 machine of the
validation tables in docs/benchmarks.md, and on a slower one they overload every
configuration, so that each run is its admission queue filling up (a diurnal run on a 2-core
AVX2 EPYC: median TTFTs of 15-22 s, requests refused with 429, goodput 0) rather than the
regime a user sizes a cluster for.

A workload whose results file already exists in DIR is not measured again unless --remeasure:
a change to the simulator is checked against the same runs; a change to the engine's speed
needs new runs (--remeasure). Measuring is long (each workload runs every configuration for
--duration seconds, plus start-up): run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import measured_spread, simulator_context
from pdserve.bench.simulator_ranking import rank_line, rankings
from pdserve.planner.simulate.calibration_pool import SEPARATOR, same_job_pool
from pdserve.planner.simulate.file_spec import steps_path
from pdserve.planner.simulate.measured_compare import CLIFF_TEXT, ELASTIC, on_the_cliff
from pdserve.planner.simulate.measured_run import NOT_MERGED, served_merged
from pdserve.planner.simulate.speed_scale import SPEED_REFERENCE_MODES
from pdserve.planner.simulate.speed_timeline import WINDOW_S, check_window

CONFIGS = ("collocated", "collocated-chunked", "disagg")
# what the simulator can lay out: elastic while its pair stays merged (measured_compare.py)
SIMULATED = (*CONFIGS, "disagg-local", "disagg-remote", "elastic")
# bench compare flags of each workload (the trace; --duration is added)
WORKLOADS: dict[str, tuple[str, ...]] = {
    "mixed": ("--workload", "mixed", "--rate", "1"),
    "chat": ("--workload", "chat", "--concurrency", "16"),
    "long": ("--workload", "rag", "--rate", "0.4"),
    "diurnal": ("--workload", "diurnal", "--rate", "0.4"),
    "prefix": ("--workload", "prefix", "--rate", "1"),
}
FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "request_goodput",
           "output_throughput")
SIM_MODELS = {"smollm2": "smollm2-135m"}  # bench's model name -> simulate's preset
SLO_TTFT_MS, SLO_TPOT_MS = 2000.0, 100.0  # goodput's bounds (`pdserve up`'s TPOT target too)
ROUNDS_MARK = ("; ~ its measured rounds moved by more than its tolerance: noise, which no "
               "simulation is held to")


@dataclass(frozen=True)
class CheckSettings:
    out_dir: Path
    calibrate_on: str
    held_out: tuple[str, ...]
    configs: tuple[str, ...]
    duration_s: float
    model: str
    remeasure: bool
    decode_context: str = "measured"  # simulator_context.MODES
    decode_context_us: float | None = None  # held for every configuration (overrides the mode)
    speed_reference: str = "scale"  # `pdserve simulate --speed-reference`
    load: float = 1.0  # factor on every open-loop workload's request rate
    repeats: int = 1  # bench compare --repeats: rounds of every configuration, interleaved
    speed_window_s: float = WINDOW_S  # `pdserve simulate --speed-window` (steps only)
    slo_itl_ms: float | None = None  # bench compare --slo-itl-ms: the paced steps' ceiling
    own_steps: bool = False  # fit each configuration on its own steps, pooled with no other

    def __post_init__(self) -> None:
        for name in (self.calibrate_on, *self.held_out):
            if name not in WORKLOADS:
                raise ValueError(f"unknown workload {name!r}; choose from "
                                 f"{', '.join(WORKLOADS)}")
        if self.calibrate_on in self.held_out:
            raise ValueError(f"{self.calibrate_on!r} is the calibration workload; a held-out "
                             "workload must be another")
        if not self.held_out or not self.configs:
            raise ValueError("needs at least one held-out workload and one configuration")
        unknown = [c for c in self.configs if c not in SIMULATED]
        if unknown:
            raise ValueError(f"configurations {unknown} cannot be simulated; choose from "
                             f"{', '.join(SIMULATED)}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be positive, got {self.duration_s!r}")
        if not 0 < self.load <= 100:
            raise ValueError(f"load must be in (0, 100], got {self.load!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or \
                self.repeats < 1:
            raise ValueError(f"repeats must be a whole number >= 1, got {self.repeats!r}")
        if self.speed_reference not in SPEED_REFERENCE_MODES:
            raise ValueError(f"speed_reference must be one of {', '.join(SPEED_REFERENCE_MODES)}, "
                             f"got {self.speed_reference!r}")
        check_window(self.speed_window_s)
        if self.slo_itl_ms is not None and not self.slo_itl_ms >= SLO_TPOT_MS:
            raise ValueError(f"slo_itl_ms must be at least the {SLO_TPOT_MS:g} ms TPOT target, "
                             f"got {self.slo_itl_ms!r}")
        if self.decode_context not in simulator_context.MODES:
            raise ValueError(f"decode_context must be one of "
                             f"{', '.join(simulator_context.MODES)}, got {self.decode_context!r}")


def add_simulator_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True,
                   help="folder for each workload's bench compare results and the summary "
                        "(simulator_check.json); results already there are reused")
    p.add_argument("--calibrate-on", default="diurnal",
                   help=f"the workload the step costs are fitted on (one of "
                        f"{', '.join(WORKLOADS)}; default: %(default)s, whose phases have long "
                        "contexts at few streams and short ones at many, which a steady "
                        "workload cannot tell apart)")
    p.add_argument("--held-out", default="mixed,chat,long,prefix",
                   help="workloads to predict, comma-separated (default: %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="pdserve configurations (default: %(default)s)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals per workload and configuration (diurnal: three "
                        "phases of a third each; default: %(default)s)")
    p.add_argument("--model", default="smollm2", help="default: %(default)s")
    p.add_argument("--load", type=float, default=1.0,
                   help="multiply every open-loop workload's request rate by this (mixed 1, "
                        "long 0.4, diurnal 0.4 and prefix 1 req/s at 1; chat is 16 clients in "
                        "a closed loop at any load); below 1 on a machine slower than the "
                        "2-core AVX-512 one they are sized for (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="measure each workload with `bench compare --repeats N`: N rounds of "
                        "every configuration, interleaved, so that the machine's drift falls on "
                        "every configuration alike; each figure is then the median of N runs, "
                        "simulated once and priced at all the rounds' speed references pooled "
                        "(results already in --out keep the rounds they were measured with; "
                        "default: %(default)s)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure every workload again even if its results are in --out")
    p.add_argument("--speed-reference", choices=SPEED_REFERENCE_MODES, default="scale",
                   help="scale each calibration to the held-out run's speed by the fixed engine "
                        "jobs bench compare times around every run (`pdserve simulate "
                        "--speed-reference`; runs without one are priced unscaled): scale, "
                        "every cost by the prefill job; split, the decode costs by the decode "
                        "job; ignore the references; or steps, a diagnostic and not a "
                        "prediction: price each step at the speed the held-out run's own "
                        "steps ran at in its window, which shows what the model misses once "
                        "the machine's drift within the run is taken out (default: "
                        "%(default)s)")
    p.add_argument("--speed-window", type=float, default=WINDOW_S, metavar="S",
                   help="with --speed-reference steps: the windows the held-out run's own speed "
                        "is read in, in seconds (`pdserve simulate --speed-window`; longer than "
                        "the run: one factor per kind of step for the whole run; default: "
                        "%(default)g)")
    p.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="let the split and elastic workers' paced steps run to MS while their "
                        "credit or a late prompt allows (bench compare --slo-itl-ms; "
                        "default: steps within the 100 ms TPOT target)")
    p.add_argument("--own-steps", action="store_true",
                   help="fit each configuration's step costs on its own steps in the "
                        "calibration run (default: pooled with those of the configurations "
                        "whose workers computed on as many threads, priced at its speed)")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--decode-context", choices=simulator_context.MODES, default="measured",
                      help="the decode cost per context token: measured (default) by `bench "
                           "decode-context` on as many threads as each configuration's workers "
                           "compute on, once per thread count (decode_context.json in --out, "
                           "reused), and held; or fitted on the calibration run with the other "
                           "step costs")
    held.add_argument("--decode-context-us", type=float, default=None, metavar="US",
                      help="hold it at this for every configuration (`pdserve simulate "
                           "--decode-context-us`)")


def settings(args: argparse.Namespace) -> CheckSettings:
    return CheckSettings(args.out, args.calibrate_on, _names(args.held_out),
                         _names(args.configs), args.duration, args.model, args.remeasure,
                         args.decode_context, args.decode_context_us, args.speed_reference,
                         args.load, args.repeats, args.speed_window, args.slo_itl_ms,
                         args.own_steps)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def workload_args(name: str, load: float) -> tuple[str, ...]:
    """bench compare's flags for the workload, its --rate (if any) multiplied by `load`."""
    args = list(WORKLOADS[name])
    if "--rate" in args:
        at = args.index("--rate") + 1
        args[at] = f"{float(args[at]) * load:g}"
    return tuple(args)


def _reused_rate(out: Path, name: str, load: float, itl_ms: float | None) -> None:
    """Refuse results measured at another rate than this load asks (None: a closed loop), or
    with another ITL ceiling."""
    args = workload_args(name, load)
    want = float(args[args.index("--rate") + 1]) if "--rate" in args else None
    results = {c: r for c, r in json.loads(out.read_text()).items() if isinstance(r, dict)}
    # recorded by the configurations that pace steps (split and elastic workers) only
    ceilings = {c: r.get("slo_itl_ms") for c, r in results.items()}
    if any(v is not None and v != itl_ms for v in ceilings.values()):
        raise ValueError(f"{out} was measured with ITL ceilings {ceilings} (ms), not "
                         f"{itl_ms} (--slo-itl-ms): --remeasure, or another --out")
    rates = {c: r.get("request_rate") for c, r in results.items()}
    wrong = {c: r for c, r in rates.items() if r is not None and r != want}
    if wrong:
        asked = "a closed loop" if want is None else f"{want:g} req/s"
        raise ValueError(f"{out} was measured at request rates {wrong}, not {asked} "
                         f"(--load {load:g}): --remeasure, or another --out")


def _measure(s: CheckSettings, workload: str) -> Path:
    """DIR/<workload>.json, measured now unless it is there already."""
    out = s.out_dir / f"{workload}.json"
    if out.exists() and not s.remeasure:
        _reused_rate(out, workload, s.load, s.slo_itl_ms)
        print(f"{workload}: reusing {out}", file=sys.stderr)
        return out
    argv = [sys.executable, "-m", "pdserve.cli", *compare_args(s, workload, out)]
    print(f"{workload}: measuring ({' '.join(argv[3:])})", file=sys.stderr)
    subprocess.run(argv, check=False)  # failed requests exit 1 but still write the results
    if not out.exists():
        raise RuntimeError(f"bench compare wrote no results for {workload} ({out})")
    return out


def compare_args(s: CheckSettings, workload: str, out: Path) -> list[str]:
    """`pdserve bench compare`'s arguments that measure `workload` into `out`."""
    extra = ("--phase-s", f"{s.duration_s / 3:g}") if workload == "diurnal" else ()
    rounds = ("--repeats", str(s.repeats)) if s.repeats > 1 else ()
    ceiling = () if s.slo_itl_ms is None else ("--slo-itl-ms", f"{s.slo_itl_ms:g}")
    return ["bench", "compare", "--configs", ",".join(s.configs), "--model", s.model,
            *workload_args(workload, s.load), *extra, *rounds, "--duration", f"{s.duration_s:g}",
            "--slo-ttft-ms", f"{SLO_TTFT_MS:g}", "--slo-tpot-ms", f"{SLO_TPOT_MS:g}", *ceiling,
            "--out", str(out)]


def _simulate(s: CheckSettings, calibration: Path, measured: Path, config: str,
              pool: tuple[str, ...], held_us: float | None) -> dict[str, Any]:
    steps = steps_path(calibration)
    argv = [sys.executable, "-m", "pdserve.cli", "simulate",
            "--model", SIM_MODELS.get(s.model, s.model), "--gpu", "cpu",
            "--calibrate", f"{steps}:{SEPARATOR.join(pool)}",
            "--compare-measured", f"{measured}:{config}",
            "--json", "--speed-reference", s.speed_reference]
    if s.speed_reference == "steps":
        argv += ["--speed-window", f"{s.speed_window_s:g}"]
    if held_us is not None:
        argv += ["--decode-context-us", f"{held_us:g}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve simulate failed for {measured.name}:{config}: "
                           f"{done.stderr.strip()}")
    return json.loads(done.stdout)["measured"]


def run_check(s: CheckSettings) -> dict[str, Any]:
    """Measure what is missing, simulate every (held-out workload, configuration) that has a
    layout to simulate (`unsimulated`: those that do not, and why)."""
    s.out_dir.mkdir(parents=True, exist_ok=True)
    calibration = _measure(s, s.calibrate_on)
    calibrated = json.loads(calibration.read_text())
    held = _held_context(s, calibrated)
    pools = {c: (c,) if s.own_steps else _pool(calibrated, c, s.configs) for c in s.configs}
    rows, results, unsimulated = [], {}, []
    for workload in s.held_out:
        measured = _measure(s, workload)
        results[workload] = json.loads(measured.read_text())
        for config in s.configs:
            why = _changed_layout(calibrated, results[workload], config)
            if why is not None:
                unsimulated.append({"workload": workload, "config": config, "why": why})
                continue
            got = _simulate(s, calibration, measured, config, pools[config],
                            held["us"][config])
            rows.append({"workload": workload, "config": config, **got,
                         "outside": _outside(got),
                         **_rounds(results[workload].get(config, {}), got["tolerance"])})
    ranking = rankings(rows, results)
    return {"calibrated_on": s.calibrate_on, "duration_s": s.duration_s, "model": s.model,
            "load": s.load, "repeats": s.repeats, "slo_itl_ms": s.slo_itl_ms,
            "decode_context": held, "pools": pools, "speed_reference": s.speed_reference,
            "speed_window_s": s.speed_window_s if s.speed_reference == "steps" else None,
            "rows": rows, "unsimulated": unsimulated,
            "ranking": ranking}


def _pool(results: dict[str, Any], config: str, configs: tuple[str, ...]) -> tuple[str, ...]:
    """calibration_pool.same_job_pool, less the configurations whose workers computed on
    another number of threads (simulator_context.worker_threads: an elastic pair served
    merged times its reference on one worker's cores and computes on all of them)."""
    def threads(c: str) -> int | None:
        try:
            return simulator_context.worker_threads(results, c, simulator_context.cores())
        except ValueError:
            return None
    own = threads(config)
    return tuple(c for c in same_job_pool(results, config, configs)
                 if c == config or (own is not None and threads(c) == own))


def _changed_layout(calibration: dict[str, Any], held_out: dict[str, Any], config: str
                    ) -> str | None:
    """Why an elastic configuration's run has no layout to simulate (its pair did not stay
    merged in the calibration run or the held-out one: measured_run.served_merged); None
    where it has one."""
    if config != ELASTIC:
        return None
    runs = (("calibration", calibration), ("held-out", held_out))
    changed = [name for name, results in runs if not served_merged(results.get(config, {}))]
    if not changed:
        return None
    return (f"the elastic pair did not stay merged in the {' and '.join(changed)} run "
            f"({NOT_MERGED}): a layout that changed during the run")


def _held_context(s: CheckSettings, results: dict[str, Any]) -> dict[str, Any]:
    """{"mode", "us": config -> held us per context token (None: fitted), "threads": config ->
    its workers' threads (measured mode only)}, simulator_context's rule; `results` the
    calibration run's."""
    if s.decode_context_us is not None:
        return {"mode": "held", "us": dict.fromkeys(s.configs, s.decode_context_us)}
    if s.decode_context == "fitted":
        return {"mode": "fitted", "us": dict.fromkeys(s.configs)}
    cores = simulator_context.cores()
    threads = {c: simulator_context.worker_threads(results, c, cores) for c in s.configs}
    costs = simulator_context.measured_costs(s.out_dir, s.model, set(threads.values()),
                                             s.remeasure)
    return {"mode": "measured", "us": {c: costs[t] for c, t in threads.items()},
            "threads": threads}


def _rounds(result: dict[str, Any], tolerance: dict[str, float]) -> dict[str, Any]:
    """A repeated run's {"rounds": figure -> its value in every round, "noise": the figures
    whose rounds moved by more than their tolerance (measured_spread.py)}; {} for one round."""
    each = {f: v for f in FIGURES if (v := measured_spread.rounds(result, f))}
    if not each:
        return {}
    return {"rounds": each,
            "noise": [f for f, v in each.items() if measured_spread.apart(v, tolerance[f])]}


def _outside(got: dict[str, Any]) -> list[str]:
    """The figures whose |relative error| is over their tolerance."""
    return [k for k in FIGURES
            if (e := got["rel_error"].get(k)) is not None and abs(e) > got["tolerance"][k]]


def format_check(summary: dict[str, Any]) -> str:
    """One line per (workload, configuration): each figure measured -> simulated (error)."""
    head = ["workload", "config"] + [f.replace("_ms", "") for f in FIGURES] + \
        ["itl>p99", "local_prefills(measured/simulated)", "speed",
         "steps(measured/priced: median/time)"]
    load = summary.get("load", 1.0)
    rounds = any("rounds" in r for r in summary["rows"])
    lines = [f"held-out validation, step costs fitted on {summary['calibrated_on']!r}"
             f"{'' if load == 1.0 else f', open-loop rates x{load:g}'}"
             f"{_held_text(summary.get('decode_context'))}"
             f"{_pools_text(summary.get('pools'))}"
             f"{_split_text(summary.get('speed_reference'), summary.get('speed_window_s'))}"
             f"{_ceiling_text(summary.get('slo_itl_ms'))}"
             f" (measured -> simulated, error; * outside its tolerance"
             f"{ROUNDS_MARK if rounds else ''})", "  ".join(head)]
    for r in summary["rows"]:
        cells = [r["workload"], r["config"]]
        for f in FIGURES:
            m, sim, err = r["measured"].get(f), r["simulated"].get(f), r["rel_error"].get(f)
            flag = ("*" if f in r["outside"] else "") + ("~" if f in r.get("noise", ()) else "")
            cells.append("-" if m is None or sim is None or err is None else
                         f"{m:.3g}->{sim:.3g} ({err:+.0%}){flag}")
        above = r.get("itl_above_p99")
        cells += ["-" if above is None else f"{above:.1%}",
                  _local_prefills(r.get("local_prefills"), r.get("paths")),
                  _speed(r.get("speed_scale"), r.get("decode_speed_scale"))
                  if "speed_timeline" not in r else _own_speed(r["speed_timeline"]),
                  _steps(r.get("step_ratios"))]
        lines.append("  ".join(cells))
    lines += [f"{u['workload']}  {u['config']}  not simulated: {u['why']}"
              for u in summary.get("unsimulated", ())]
    lines.append(_count_line(summary["rows"], rounds))
    lines += [rank_line(workload, rank) for workload, rank in summary["ranking"].items()]
    return "\n".join(lines)


def _count_line(rows: list[dict[str, Any]], rounds: bool) -> str:
    """"N of M figures outside their tolerance", for repeated runs how many of those are
    noise (~), and how many P99 ITL misses are on the stalls' cliff (measured_compare.py)."""
    figures = sum(1 for r in rows for f in FIGURES if r["rel_error"].get(f) is not None)
    out = sum(len(r["outside"]) for r in rows)
    noise = sum(1 for r in rows for f in r["outside"] if f in r.get("noise", ()))
    p99 = [r for r in rows if "p99_itl_ms" in r["outside"]]
    cliff = sum(1 for r in p99 if on_the_cliff(r.get("itl_above_p99")))
    return (f"{out} of {figures} figures outside their tolerance"
            + (f", {noise} of them noise (~)" if rounds else "")
            + (f"; {cliff} of {len(p99)} P99 ITL misses on the stalls' cliff (itl>p99 "
               f"{CLIFF_TEXT})" if p99 else ""))


def _pools_text(pools: dict[str, list[str]] | None) -> str:
    """", steps pooled: collocated+collocated-chunked" for the calibrations fitted on more
    than their own configuration's steps."""
    pooled = [SEPARATOR.join(p) for p in (pools or {}).values() if len(p) > 1]
    return f", steps pooled: {', '.join(pooled)}" if pooled else ""


def _split_text(mode: str | None, window_s: float | None = None) -> str:
    """", decode costs scaled by the decode job" under --speed-reference split; the diagnostic
    under steps."""
    if mode == "steps":
        return (", a diagnostic and not a prediction: each step priced at the speed the "
                f"held-out run's own steps ran at in its {window_s or WINDOW_S:g} s window "
                "(speed: prompt/decode over the run, the windows' range)")
    return ", prompt costs scaled by the prefill job and decode costs by the decode job" \
        if mode == "split" else ""


def _ceiling_text(itl_ms: float | None) -> str:
    """", paced steps up to 300 ms" where the runs had an ITL ceiling."""
    return "" if itl_ms is None else f", paced steps up to {itl_ms:g} ms"


def _held_text(held: dict[str, Any] | None) -> str:
    """", decode context cost held at ...": what the decode context cost was held at."""
    if held is None or held["mode"] == "fitted":
        return ""
    if held["mode"] == "held":
        return f", decode context cost held at {next(iter(held['us'].values())):g} us/token"
    each = []
    for config, us in held["us"].items():
        t = held["threads"][config]
        each.append(f"{config} {us:.3g} us/token ({t} thread{'s' if t > 1 else ''})")
    return f", decode context cost held at bench decode-context's: {', '.join(each)}"


def _steps(ratios: dict[str, Any] | None) -> str:
    """"decode x1.23/1.41 (beside x1.37, alone x0.99) mixed x1.12/1.20": the held-out run's
    steps, measured / priced by the calibration, per kind, the median step's and the kind's
    time's, and a decode worker's decode steps' median beside a computing prefill worker and
    alone where the run has both (step_check.py); "-" without its steps."""
    if not ratios:
        return "-"
    return " ".join(f"{kind} x{r['median_ratio']:.2f}/{r['time_ratio']:.2f}" + (
        f" (beside x{r['beside']:.2f}, alone x{r['alone']:.2f})" if "beside" in r else "")
        for kind, r in ratios.items())


def _speed(factor: float | None, decode: float | None = None) -> str:
    """"x1.05": the calibration's factor to the held-out run's speed reference (`pdserve
    simulate`'s speed_scale.py), ", decode x1.20" the decode job's beside it where both runs
    timed it (applied to the decode costs only with --speed-reference split: the header says);
    "-" where it was not scaled."""
    if factor is None:
        return "-"
    return f"x{factor:.2f}" + ("" if decode is None else f", decode x{decode:.2f}")


def _own_speed(timeline: dict[str, Any]) -> str:
    """"own x1.05/0.98 (x0.60-1.80)": under --speed-reference steps, the held-out run's prompt
    and decode steps' speed over the run and the range of its windows' (speed_timeline.py)."""
    every = [*timeline["prompt"], *timeline["decode"]]
    return (f"own x{timeline['prompt_run']:.2f}/{timeline['decode_run']:.2f} "
            f"(x{min(every):.2f}-{max(every):.2f})")


def _local_prefills(counts: dict[str, Any] | None, paths: dict[str, Any] | None) -> str:
    """"measured/simulated" local prefills of a split configuration, else "-"; with the
    requests' routes, ", N/M same path" (`pdserve simulate`'s path_agreement.py)."""
    if counts is None:
        return "-"
    measured = counts.get("measured")
    same = "" if paths is None else f", {paths['same']}/{paths['compared']} same path"
    return f"{'-' if measured is None else format(measured, 'g')}/{counts['simulated']}{same}"


def run_simulator_check_cli(args: argparse.Namespace) -> int:
    s = settings(args)
    summary = run_check(s)
    (s.out_dir / "simulator_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(format_check(summary))
    within = all(not r["outside"] for r in summary["rows"]) and not summary["unsimulated"]
    agree = all(r["agree"] for r in summary["ranking"].values())
    return 0 if within and agree else 1
