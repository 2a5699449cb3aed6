"""`pdserve bench compare`: the same trace against several serving configurations, one after
the other, on the same cores, in one run; one table with the ratio to the first.

Each pdserve configuration is started here with `pdserve up` on the first `cores` cores
(collocated: one worker on all of them; collocated-2: two collocated workers, the cores split
between them, what the elastic pools become when every worker decodes; disagg: one prefill
and one decode worker, the cores split between them; elastic: disagg's workers, whose roles
the router flips itself, `pdserve up --elastic`), warmed up with two requests (the workload's,
drawn from its next seed: `warm_up_requests`; `warm_up` in the results, each request's
`prompt_tokens` and `output_tokens`, which `pdserve simulate` serves before it replays the
run), measured with `bench serve`'s runner, and
stopped before the next starts. Before the stop the router's `pdserve_role_flips_total` is
read: `role_flips` (all directions) and `role_flips_by` ("decode->prefill": n, ...), its
`pdserve_core_loans_total{event="lent"}`: `core_loans` (a prefill worker's cores lent to a
decode worker, `router/core_lending.py`), and `{event="reclaimed"}`: `core_reclaims` (taken
back, the pair split again); and its
`pdserve_router_split_decisions_total`, once after the warm-up and once after the run, whose
difference is `split_decisions`: the measured requests' paths on decode workers, {"local": n,
"remote": m, "by_reason": {"local/measured_cost": n, "remote/unmeasured": k, ...}} ("remote"
is the metric's "disaggregated"; a collocated worker's requests are no split decision and are
left out, so a collocated configuration has zeros). Workers
keep a ring of their engine steps and a history of their roles; both, over the measured run,
are fetched before the stop: the steps for the timeline picture, the roles for `workers` (per
worker: `index` and `url` in `pdserve up`'s order, `roles` as the worker gave them,
`role_seconds` spent in each role during the run, `flips` completed in it; `bench/role_time.py`;
`steps`, what its engine did in the run, `bench/step_summary.py`, a line each under the table)
and `run_window` (the run's wall-clock start and end). Workers are named by their role when the
measured run began, numbered per role in `pdserve up`'s order ("prefill-0"): one name for the
whole run, whatever flips came later. The table gets a line of each flipping configuration's
seconds per role. After the run, before the stop, the idle cluster answers a few one-token
probes (`bench/frontend_probe.py`): `frontend_probe`, the front end's round trip that `pdserve
simulate` adds to every TTFT. Before the cluster starts and after it stops, a fixed engine job is
timed alone on the threads each of the configuration's workers computes on
(`bench/speed_reference.py`): `speed_reference`, how fast the machine was around the run, by
which `pdserve simulate` scales a calibration measured at another time (`--no-speed-reference`:
none). `--external NAME=URL` adds a server someone else started (vLLM, see
docs/vllm.md) to the same table.

`--testbed` (root) runs every pdserve configuration across the hosts of a testbed made for the
compare run (router, p0, d0; every link shaped to `--link-gbps`) and removed after it: the
client, the warm-up and every metrics read run inside the router's host, so requests cross the
router's link and KV the p0-d0 one. `disagg-local` and `disagg-remote` are disagg with the
split rule fixed (every prompt prefilled on the decode worker, or every prompt on the prefill
worker), the baselines of the measured-cost rule that plain disagg uses.

Repeats (`--repeats N`, default 1). Invariants:
- Every configuration, pdserve's and external ones alike, replays the same trace (same seed)
  N times, in rounds: round r runs each configuration once, in the order given (pdserve's,
  then externals), before round r + 1 starts (A, B, C, A, B, C, ...), so slow drift of a
  shared machine falls on every configuration alike.
- Every run of a pdserve configuration (and of an external one with `--external-start`) is a
  fresh start, warm-up, replay and stop: configurations must never share the cores, so a
  cluster cannot stay up across rounds, and each repeat samples the whole procedure that a
  single run measures.
- The table and `--out` give, per configuration, the median over its runs of every metric
  (`median_of_runs`; the same vLLM `bench serve` names as one run); ratios are ratios of
  medians. `--out` keeps every run's metrics, in run order, under `repeats`.
- `split_decisions` too: each count (local, remote, each path/reason) is the median of that
  count over the runs (a run without a reason counts 0 for it), so the parts need not add up
  to the whole; every run's own counts are under `repeats`.
- The step traces (`X.steps.json`) hold every round's steps, each worker's in round order
  (`merge_rounds`), and each pdserve configuration's result says so with `steps_rounds`: N
  (a fit on them is priced at every round's speed reference; a file without the key holds the
  last round's alone). The `requests`, `workers`, `run_window`, `frontend_probe` and
  `speed_reference` in `--out`, and the `--plots` pictures are those of the last round (every
  run's `speed_reference` is under `repeats` too, and its requests' outcomes, `OUTCOME_KEYS`
  of each in trace order, without their token gaps: what pairs two configurations request by
  request over every round, paired_goodput.py).
- With N = 1 every output is exactly that of a single run (no `repeats` key).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import speed_reference
from pdserve.bench.frontend_probe import PROBE_TOKENS, probe_frontend
from pdserve.bench.paired_rounds import paired_lines
from pdserve.bench.role_time import flips_within, format_role_seconds, role_at, role_seconds
from pdserve.bench.serve.metrics import MAX_ERRORS, Slo, distribution_ms
from pdserve.bench.serve.runner import (
    Load,
    add_workload_args,
    run_bench,
    settings_from_args,
)
from pdserve.bench.serve.workloads import WORKLOAD_KINDS, RequestSpec, Workload
from pdserve.bench.step_summary import format_summary, summarize
from pdserve.cluster import parent_death
from pdserve.cluster.bed_up_process import BedUpProcess
from pdserve.cluster.up_process import UpProcess, get_json
from pdserve.common.numbers import is_finite_number
from pdserve.planner.simulate.file_spec import steps_path
from pdserve.testbed import lifecycle
from pdserve.testbed.state import BedState
from pdserve.testbed.topology import LinkShape, Topology

CONFIGS: dict[str, tuple[str, ...]] = {
    "collocated": ("--collocated", "1"),
    "collocated-chunked": ("--collocated", "1", "--enable-chunked-prefill"),
    "collocated-2": ("--collocated", "2"),
    "disagg": ("--prefill", "1", "--decode", "1"),
    "disagg-local": ("--prefill", "1", "--decode", "1", "--local-prefill-threshold",
                     str(2**31 - 1)),
    "disagg-remote": ("--prefill", "1", "--decode", "1", "--local-prefill-threshold", "0"),
    "elastic": ("--prefill", "1", "--decode", "1", "--elastic"),
}
EXTERNAL_READY_S = 900.0  # vLLM compiles its model graphs at start-up
WARM_UP_TOKENS = 4  # max_tokens of each warm-up request
TABLE_KEYS = ("completed", "failed", "request_throughput", "output_throughput",
              "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
              "p90_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
              "role_flips", "core_loans")
# The numeric keys of `compute_metrics` (all of them but `errors`): what repeats take medians of.
METRIC_KEYS: tuple[str, ...] = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    *(key for name in ("ttft", "tpot", "itl", "e2el") for key in distribution_ms(name, [])))
# What a request's SLO verdict reads (serve/metrics.py `within_slo`), kept for every round.
OUTCOME_KEYS = ("ok", "ttft_s", "tpot_s", "e2e_s")
# Read from a pdserve cluster's router (none for an external server): medians over repeats too.
CLUSTER_KEYS = ("role_flips", "core_loans", "core_reclaims")
# One sample of a Prometheus text exposition: name, {labels} (maybe none), value.
SAMPLE_LINE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<n>\S+)")
LABEL = re.compile(r'(?P<key>\w+)="(?P<value>(?:[^"\\]|\\.)*)"')
SPLITS = "pdserve_router_split_decisions_total"
# The metric's path label -> split_decisions' key; reason collocated_worker is no split
SPLIT_PATHS = {"local": "local", "disaggregated": "remote"}
NOT_A_SPLIT = "collocated_worker"


@dataclass(frozen=True)
class CompareSettings:
    configs: tuple[str, ...]
    externals: tuple[tuple[str, str], ...]
    cores: int
    model: str
    workload: Workload
    load: Load
    slo: Slo
    timeout_s: float
    up_args: tuple[str, ...] = ()
    starts: tuple[tuple[str, str], ...] = ()  # external name -> command that serves it
    repeats: int = 1  # runs of each configuration, interleaved in rounds
    testbed: LinkShape | None = None  # run pdserve's configurations across testbed hosts
    speed_reference: bool = True  # time bench/speed_reference.py's job around each run

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise ValueError(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
        names = list(self.configs) + [n for n, _ in self.externals]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"configuration names must be given and unique, got {names}")
        orphans = [n for n, _ in self.starts if n not in dict(self.externals)]
        if orphans:
            raise ValueError(f"--external-start names {orphans} have no --external NAME=URL")
        available = len(os.sched_getaffinity(0))
        if not 1 <= self.cores <= available:
            raise ValueError(f"--cores must be in 1..{available} (the cores this process may "
                             f"use), got {self.cores}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every configuration's name, in run order: pdserve's, then the externals."""
        return (*self.configs, *(n for n, _ in self.externals))

    @property
    def cpus(self) -> str:
        return ",".join(map(str, sorted(os.sched_getaffinity(0))[: self.cores]))


def warm_up_requests(workload: Workload) -> list[RequestSpec]:
    """The first two requests of the workload drawn from its next seed: first-use costs go off
    the clock, and no prompt of the trace is in a worker's prefix cache before the run (with
    the trace's own seed its first two requests would be prefix hits, unlike the simulator's
    replay, and their prefill steps of a block or two would pull down the decode worker's
    measured prefill rate, which the router's split decision reads)."""
    other = dataclasses.replace(workload, seed=workload.seed + 1)
    return other.requests(1.0, num_requests=2)


def serve_warm_up(url: str, model: str, workload: Workload) -> list[dict[str, int]]:
    """`warm_up_requests`, a few tokens each, one after the other; what was served: each
    one's prompt_tokens and output_tokens (its usage)."""
    served = []
    for spec in warm_up_requests(workload):
        body = json.dumps({"model": model, "prompt": list(spec.prompt_token_ids),
                           "max_tokens": WARM_UP_TOKENS, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            usage = json.loads(resp.read()).get("usage") or {}
        served.append({"prompt_tokens": len(spec.prompt_token_ids),
                       "output_tokens": usage.get("completion_tokens", WARM_UP_TOKENS)})
    return served


def _workers(up: UpProcess, start: float, end: float
             ) -> tuple[dict[str, list[list[float]]], dict[str, dict[str, Any]], list[float]]:
    """(steps, `workers` entry) of every worker over the run [start, end], by worker name,
    and the seconds of the probes' prompt steps after it (`probe_steps`)."""
    steps, workers, index, counts, after = {}, {}, 0, {}, []
    while True:
        try:
            url = up.worker_url(index)
            trace = up.internal_json(f"{url}/internal/steps?since={start!r}")
        except OSError:  # past the last worker
            return steps, workers, probe_steps(after)
        role = role_at(trace["roles"], start)
        name = f"{role}-{counts.get(role, 0)}"
        counts[role] = counts.get(role, 0) + 1
        steps[name] = [row for row in trace["steps"] if row[0] <= end]  # not the probes
        after += [row for row in trace["steps"] if row[0] > end]
        workers[name] = {**worker_roles(index, url, trace["roles"], start, end),
                         "steps": summarize(steps[name], start, end)}
        index += 1


def probe_steps(rows: list[list[float]]) -> list[float]:
    """The seconds of each step that computed a probe's prompt (PROBE_TOKENS prompt tokens,
    no stream beside it: the probes go one after the other to an idle cluster), in the
    probes' order, from the workers' step rows after the run."""
    mine = sorted(r for r in rows if r[2] == PROBE_TOKENS and r[3] == 0)
    return [r[1] - r[0] for r in mine]


def worker_roles(index: int, url: str, roles: list[dict[str, Any]], start: float,
                 end: float) -> dict[str, Any]:
    """A worker's `workers` entry for the run [start, end] (wall-clock seconds)."""
    return {"index": index, "url": url, "roles": roles,
            "role_seconds": role_seconds(roles, start, end),
            "flips": len(flips_within(roles, start, end))}


def router_metrics(router_url: str) -> str:
    """The router's /metrics text (`router_url` without /v1)."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def counter_samples(text: str, name: str) -> Iterator[tuple[dict[str, str], int]]:
    """(labels, value rounded to an integer) of each sample of counter `name` in `text`."""
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match is not None and match["name"] == name:
            labels = {m["key"]: m["value"] for m in LABEL.finditer(match["labels"] or "")}
            yield labels, round(float(match["n"]))


def flips_from_metrics(text: str) -> dict[str, Any]:
    """`role_flips`, `role_flips_by` ("decode->prefill": n), `core_loans` (cores lent) and
    `core_reclaims` (taken back) from the router's /metrics."""
    by: dict[str, int] = {}
    for labels, n in counter_samples(text, "pdserve_role_flips_total"):
        key = f"{labels.get('from')}->{labels.get('to')}"
        by[key] = by.get(key, 0) + n
    events: dict[str, int] = {}
    for labels, n in counter_samples(text, "pdserve_core_loans_total"):
        event = labels.get("event", "")
        events[event] = events.get(event, 0) + n
    return {"role_flips": sum(by.values()), "role_flips_by": by,
            "core_loans": events.get("lent", 0), "core_reclaims": events.get("reclaimed", 0)}


def split_counts(text: str) -> dict[str, int]:
    """The router's split decisions since it started by "local/<reason>" and
    "remote/<reason>", from its /metrics; a collocated worker's requests left out."""
    by: dict[str, int] = {}
    for labels, n in counter_samples(text, SPLITS):
        path, reason = SPLIT_PATHS.get(labels.get("path", "")), labels.get("reason", "")
        if path is not None and reason != NOT_A_SPLIT:
            key = f"{path}/{reason}"
            by[key] = by.get(key, 0) + n
    return by


def split_decisions(by_reason: Mapping[str, int | float]) -> dict[str, Any]:
    """`split_decisions` from counts by "path/reason" (zero counts left out): local and remote
    are the sums of their reasons'."""
    kept = {key: n for key, n in sorted(by_reason.items()) if n}
    out: dict[str, Any] = {path: sum(n for key, n in kept.items() if key.startswith(f"{path}/"))
                           for path in SPLIT_PATHS.values()}
    out["by_reason"] = kept
    return out


def cluster_figures(text: str, before: Mapping[str, int]) -> dict[str, Any]:
    """What a run's result takes from the router's /metrics `text` read after the run:
    its role flips, and `split_decisions` of the run (the counts less `before`,
    `split_counts` read before the run)."""
    after = split_counts(text)
    run = {key: n - before.get(key, 0) for key, n in after.items()}
    return {**flips_from_metrics(text), "split_decisions": split_decisions(run)}


def splits(result: Mapping[str, Any]) -> bool:
    """Whether this configuration made split decisions (a decode worker's requests)."""
    counts = result.get("split_decisions") or {}
    return bool(counts.get("local") or counts.get("remote"))


def _turn(s: CompareSettings, name: str, repeat: int) -> str:
    """The name of a run in progress lines; the repeat only shows when there are several."""
    return name if s.repeats == 1 else f"{name} (repeat {repeat + 1}/{s.repeats})"


def run_config(s: CompareSettings, name: str, repeat: int = 0,
               bed: BedState | None = None) -> tuple[dict[str, Any], dict[str, list]]:
    """One run of a pdserve configuration, bracketed by the speed reference (when on)."""
    threads = max(1, s.cores // config_workers(name))
    before = speed_reference.measure(s.model, threads) if s.speed_reference else None
    result, steps = _serve(s, name, repeat, bed)
    if before is not None:
        result["speed_reference"] = speed_reference.bracket(
            before, speed_reference.measure(s.model, threads))
    return result, steps


def config_workers(name: str) -> int:
    """The workers `pdserve up` starts for configuration `name` (its role counts summed)."""
    flags = CONFIGS[name]
    return sum(int(flags[i + 1]) for i, flag in enumerate(flags)
               if flag in ("--collocated", "--prefill", "--decode"))


def _serve(s: CompareSettings, name: str, repeat: int, bed: BedState | None
           ) -> tuple[dict[str, Any], dict[str, list]]:
    where = f" across testbed {bed.topology.prefix}" if bed is not None else ""
    print(f"== {_turn(s, name, repeat)}: pdserve up {' '.join(CONFIGS[name])} on cores "
          f"{s.cpus}{where}", file=sys.stderr, flush=True)
    args = (*CONFIGS[name], "--cpus", s.cpus, *s.up_args)
    up = BedUpProcess(bed, s.model, *args) if bed is not None else UpProcess(s.model, *args)
    client = up.inside() if isinstance(up, BedUpProcess) else contextlib.nullcontext()
    try:
        with client:
            warm = serve_warm_up(up.url, s.model, s.workload)
            router = up.url.removesuffix("/v1")
            before = split_counts(router_metrics(router))
            start = time.time()
            result = run_bench(up.url, s.model, s.workload, s.load, s.timeout_s, s.slo)
            end = time.time()
            cluster = cluster_figures(router_metrics(router), before)
            probe = probe_frontend(up.url, s.model)
        steps, workers, probe["step_s"] = _workers(up, start, end)
        return {**result, **cluster, "warm_up": warm, "frontend_probe": probe,
                "workers": workers, "run_window": [start, end],
                "slo_itl_ms": paced_ceiling(name, s.up_args)}, steps
    finally:
        up.stop()


def run_external(s: CompareSettings, name: str, url: str, repeat: int = 0) -> dict[str, Any]:
    """Bench a server at `url`; if `s.starts` has a command for `name`, start it first (alone
    on the machine, like every pdserve configuration) and stop it afterwards."""
    command = dict(s.starts).get(name)
    started = f", started with: {command}" if command else ""
    print(f"== {_turn(s, name, repeat)}: external server at {url}{started}", file=sys.stderr,
          flush=True)
    if command is None:
        return run_bench(url, s.model, s.workload, s.load, s.timeout_s, s.slo)
    # SIGTERM when this process dies: a direct server goes with it (a script's own children
    # only if the script passes it on)
    proc = subprocess.Popen(shlex.split(command), start_new_session=True,
                            preexec_fn=parent_death.guard())
    try:
        _wait_ready(url, proc, EXTERNAL_READY_S)
        warm = serve_warm_up(url, s.model, s.workload)
        return {**run_bench(url, s.model, s.workload, s.load, s.timeout_s, s.slo),
                "warm_up": warm}
    finally:
        _stop_group(proc)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the external server exited with code {proc.returncode}")
        try:
            get_json(url.rstrip("/") + "/models", timeout=2)
            return
        except (OSError, ValueError):
            time.sleep(1)
    raise RuntimeError(f"the external server at {url} was not ready in {timeout_s:.0f} s")


def _stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def run_compare(s: CompareSettings) -> tuple[dict[str, dict], list[dict[str, dict]]]:
    """(results by configuration name, each round's worker step traces by configuration name,
    in round order).

    `s.repeats` rounds, each running every configuration once in `s.names` order; a result is
    `combine_repeats` of that configuration's runs, and with several rounds a pdserve
    configuration's says how many rounds' steps `merge_rounds` keeps (`steps_rounds`)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in s.names}
    rounds: list[dict[str, dict]] = []
    with _testbed(s.testbed) as bed:
        for repeat in range(s.repeats):
            rounds.append({})
            for name in s.configs:
                result, rounds[-1][name] = run_config(s, name, repeat, bed)
                runs[name].append(result)
            for name, url in s.externals:
                runs[name].append(run_external(s, name, url, repeat))
    results = {name: combine_repeats(r) for name, r in runs.items()}
    if s.repeats > 1:
        for name in s.configs:
            results[name]["steps_rounds"] = s.repeats
    return results, rounds


def merge_rounds(rounds: Sequence[Mapping[str, Mapping[str, list]]]) -> dict[str, dict]:
    """One steps file's {config: {worker: steps}} from every round's, each worker's steps in
    round order. A worker keeps its name across rounds (`pdserve up` names them by role and
    index); the rounds do not overlap in time, so a step's period (to the same worker's next
    step, step_fit.py) only crosses from one round to the next at a round's last step, an idle
    gap like the one after any step that finished every running request."""
    merged: dict[str, dict[str, list]] = {}
    for traces in rounds:
        for config, workers in traces.items():
            for worker, steps in workers.items():
                merged.setdefault(config, {}).setdefault(worker, []).extend(steps)
    return merged


@contextlib.contextmanager
def _testbed(shape: LinkShape | None) -> Iterator[BedState | None]:
    """A testbed of hosts router, p0 and d0 with links of `shape` for the run (removed after
    it, also on failure), or None without a shape."""
    if shape is None:
        yield None
        return
    prefix = f"pdc{os.getpid() % 100000}-"
    bed = lifecycle.up(Topology(("router", "p0", "d0"), prefix), shape)
    try:
        yield bed
    finally:
        lifecycle.down(prefix)


def median_of_runs(runs: Sequence[Mapping[str, Any]],
                   keys: Iterable[str]) -> dict[str, int | float | None]:
    """Per key, the median of the runs' values for it (`statistics.median`: the middle value
    of an odd count, the mean of the two middle values of an even count, so counts such as
    `completed` can come out as 5.5).

    A value that is not a finite number (None, as for TPOT when every output was one token;
    a missing key; NaN; a bool) is left out of that key's median rather than counted as 0,
    so the median is over the runs that measured it; the key is None when no run did."""
    if not runs:
        raise ValueError("median of no runs")
    return {key: _median(run.get(key) for run in runs) for key in keys}


def _median(values: Iterable[object]) -> int | float | None:
    numbers = [v for v in values if is_finite_number(v)]
    return statistics.median(numbers) if numbers else None


def combine_repeats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's object for the table and `--out`, from its runs in run order.

    One run: that run's result, unchanged. Several: the last run's result (its settings and
    `requests`, which `--plots` draws) with each METRIC_KEYS value replaced by the median over
    the runs (`median_of_runs`), `errors` the first MAX_ERRORS error messages of all runs in
    run order, and `repeats` every run's METRIC_KEYS, `errors` and its requests' outcomes
    (`_outcomes`), in run order."""
    if not runs:
        raise ValueError("no runs to combine")
    if len(runs) == 1:
        return runs[0]
    errors = [e for run in runs for e in run.get("errors", [])][:MAX_ERRORS]
    keys = (*METRIC_KEYS, *(k for k in CLUSTER_KEYS if any(k in run for run in runs)))
    kept = (*keys, "split_decisions", "errors", "speed_reference")
    repeats = [{**{k: run[k] for k in kept if k in run}, **_outcomes(run)} for run in runs]
    combined = {**runs[-1], **median_of_runs(runs, keys), "errors": errors, "repeats": repeats}
    counted = [run["split_decisions"] for run in runs if "split_decisions" in run]
    if counted:
        combined["split_decisions"] = median_split_decisions(counted)
    return combined


def _outcomes(run: Mapping[str, Any]) -> dict[str, Any]:
    """{"requests": each request's OUTCOME_KEYS, in trace order}, or {} for a run without
    per-request records (an external server's results read back, say)."""
    if not run.get("requests"):
        return {}
    return {"requests": [{k: r.get(k) for k in OUTCOME_KEYS} for r in run["requests"]]}


def median_split_decisions(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`split_decisions` of several runs: each count the median of that count over them (a
    reason a run never gave counts 0 there); local and remote are their own medians, so they
    need not be the sums of their reasons' medians."""
    reasons = sorted({key for run in runs for key in run.get("by_reason", {})})
    out: dict[str, Any] = {path: statistics.median(run.get(path, 0) for run in runs)
                           for path in SPLIT_PATHS.values()}
    by = {key: statistics.median(run.get("by_reason", {}).get(key, 0) for run in runs)
          for key in reasons}
    out["by_reason"] = {key: n for key, n in by.items() if n}
    return out


def every_run_completed(results: Mapping[str, Mapping[str, Any]]) -> bool:
    """True when every run of every configuration (each repeat) completed a request."""
    return all(run["completed"] for r in results.values() for run in r.get("repeats", [r]))


def format_table(results: dict[str, dict[str, Any]], repeats: int = 1) -> str:
    """Every TABLE_KEYS metric of each configuration, with its ratio to the first's; with
    repeats > 1 the values are the medians `combine_repeats` gave, and a line says so."""
    names = list(results)
    first = names[0]
    head = f"{'metric':<22}" + "".join(f"{n:>20}" for n in names)
    lines = [head, "-" * len(head)]
    for key in TABLE_KEYS:
        cells = []
        for n in names:
            v, base = results[n].get(key), results[first].get(key)
            if v is None:
                cells.append(f"{'n/a':>20}")
            elif n == first or not base:
                cells.append(f"{v:>20.2f}" if isinstance(v, float) else f"{v:>20}")
            else:
                cells.append(f"{v:>11.2f} ({v / base:4.2f}x)")
        lines.append(f"{key:<22}" + "".join(cells))
    lines.append(f"ratios are to {first}; latencies in ms, throughputs per second")
    if repeats > 1:
        lines.append(f"each value is the median of {repeats} runs (--out keeps every run under "
                     "'repeats')")
    return "\n".join(_with_split_row(lines, results) + paired_lines(results)
                     + _role_lines(results, repeats) + _step_lines(results, repeats)
                     + _split_lines(results))


def _with_split_row(lines: list[str], results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The table's `lines` with a row of local/remote prefills after its metrics when a
    configuration split prompts ("-" for those that did not)."""
    if not any(splits(r) for r in results.values()):
        return lines
    cells = [f"{_split_cell(r):>20}" for r in results.values()]
    end = 2 + len(TABLE_KEYS)  # the head, its rule and a row per metric
    return [*lines[:end], f"{'split local/remote':<22}" + "".join(cells), *lines[end:]]


def _split_cell(result: Mapping[str, Any]) -> str:
    if not splits(result):
        return "-"
    counts = result["split_decisions"]
    return f"{_count(counts['local'])}/{_count(counts['remote'])}"


def _count(n: float) -> str:
    return f"{n:g}"


def _split_lines(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The router's reasons of each configuration that split prompts."""
    split = {n: r["split_decisions"]["by_reason"] for n, r in results.items() if splits(r)}
    if not split:
        return []
    return ["split decisions by path/reason (local: prefilled on the decode worker):"] + [
        f"  {n}: " + ", ".join(f"{key} {_count(c)}" for key, c in by.items())
        for n, by in split.items()]


def changed_role(result: Mapping[str, Any]) -> bool:
    """Whether a worker of this configuration changed role during its (last) run."""
    return any(w["flips"] for w in result.get("workers", {}).values())


def _role_lines(results: Mapping[str, Mapping[str, Any]], repeats: int) -> list[str]:
    """Seconds per role of each worker, for configurations whose workers changed role."""
    flipped = {n: r["workers"] for n, r in results.items() if changed_role(r)}
    if not flipped:
        return []
    run = "the last run" if repeats > 1 else "the run"
    return [f"time in each role during {run}:"] + [
        f"  {n}: " + format_role_seconds({w: info["role_seconds"] for w, info in ws.items()})
        for n, ws in flipped.items()]


def _step_lines(results: Mapping[str, Mapping[str, Any]], repeats: int) -> list[str]:
    """What each pdserve worker's engine did during the (last) run (step_summary.py)."""
    lines = []
    for n, r in results.items():
        run_s = r["run_window"][1] - r["run_window"][0] if "run_window" in r else 0.0
        lines += [f"  {n} {w}: {format_summary(info['steps'], run_s)}"
                  for w, info in r.get("workers", {}).items() if "steps" in info]
    run = "the last run" if repeats > 1 else "the run"
    return [f"engine steps of each worker during {run}:", *lines] if lines else []


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="collocated,collocated-chunked,disagg",
                   help=f"pdserve configurations, in order, from {', '.join(CONFIGS)} "
                        "(default: %(default)s)")
    p.add_argument("--external", action="append", default=[], metavar="NAME=URL",
                   help="also measure a server already running at URL (e.g. vLLM), as NAME")
    p.add_argument("--external-start", action="append", default=[], metavar="NAME=COMMAND",
                   help="start that external server with COMMAND at its turn (so it runs "
                        "alone, like each pdserve configuration), wait until URL/models "
                        "answers, stop its process group after; e.g. vllm='tools/vllm/serve.sh "
                        "collocated --port 8200'")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores every configuration gets (default: all, %(default)s)")
    p.add_argument("--model", default="smollm2", help="default: %(default)s")
    p.add_argument("--transport", choices=["tcp", "nixl"], default="tcp",
                   help="KV transport of the disagg and elastic configurations "
                        "(default: %(default)s)")
    p.add_argument("--local-prefill-threshold", type=int, default=None, metavar="TOKENS",
                   help="disagg: prompts up to this many uncached tokens run whole on the "
                        "decode worker (default: pdserve up's)")
    p.add_argument("--workload", default="mixed", choices=WORKLOAD_KINDS,
                   help="see `pdserve bench serve --help` (default: %(default)s)")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, default=None,
                      help="open loop: Poisson requests/s (default: 1)")
    loop.add_argument("--concurrency", type=int, default=None, help="closed loop: N clients")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--duration", type=float, default=None,
                      help="seconds of arrivals (default: 60)")
    size.add_argument("--num-requests", type=int, default=None)
    add_workload_args(p.add_argument)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput: E2E bound")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="pdserve's configurations only (pdserve up --slo-itl-ms): the longest "
                        "step beside streams that a decode worker's paced prompts may take; "
                        "goodput does not count it (P99 ITL shows it)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--testbed", action="store_true",
                   help="run pdserve's configurations across the hosts of a testbed made for "
                        "the run (router, p0, d0; root): requests and KV cross shaped links")
    p.add_argument("--link-gbps", type=float, default=1.0,
                   help="with --testbed: every link's rate in Gb/s (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="replay the same trace N times against each configuration, in rounds "
                        "(A, B, C, A, B, C, ...), each run a fresh start; the table and --out "
                        "give the median of each metric over the runs, --out also every run's "
                        "metrics under 'repeats'; the step traces keep every round's steps, "
                        "--plots draws the last round (default: %(default)s)")
    p.add_argument("--no-speed-reference", dest="speed_reference", action="store_false",
                   help="do not time the fixed engine job before and after each pdserve run "
                        "(`speed_reference` in --out, ~16 s a run: what `pdserve simulate` "
                        "scales a calibration measured at another time by)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON: one object per configuration, keyed by its name, with the same "
                        "metric names as `bench serve` (and every request's timings); its "
                        "worker step traces go to the same name with .steps.json")
    p.add_argument("--plots", type=Path, default=None, metavar="DIR",
                   help="write ttft_cdf.png, itl_cdf.png and timeline.png here")
    p.set_defaults(url="http://127.0.0.1/v1")  # settings_from_args validates a URL


def settings(args: argparse.Namespace) -> CompareSettings:
    workload, load, slo = settings_from_args(args)
    externals = _pairs(args.external, "--external", "NAME=URL")
    starts = _pairs(args.external_start, "--external-start", "NAME=COMMAND")
    return CompareSettings(
        configs=tuple(c for c in args.configs.split(",") if c), externals=tuple(externals),
        cores=args.cores, model=args.model, workload=workload, load=load, slo=slo,
        timeout_s=args.timeout, up_args=_up_args(args), starts=starts, repeats=args.repeats,
        speed_reference=args.speed_reference,
        testbed=LinkShape(gbps=args.link_gbps) if args.testbed else None)


def _pairs(items: list[str], option: str, shape: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{option} wants {shape}, got {item!r}")
        pairs.append((name, value))
    return tuple(pairs)


def paced_ceiling(config: str, up_args: tuple[str, ...]) -> float | None:
    """The --slo-itl-ms that configuration `config`'s workers paced their local prompts to:
    the one given, in a split layout (`pdserve up` passes it to no collocated worker)."""
    if "--slo-itl-ms" not in up_args or "--collocated" in CONFIGS[config]:
        return None
    return float(up_args[up_args.index("--slo-itl-ms") + 1])


def _up_args(args: argparse.Namespace) -> tuple[str, ...]:
    """What every pdserve configuration is started with besides its own flags. The SLO that
    goodput is measured at is also the cluster's target: the decode workers pace their local
    prefills to its TPOT, the router's split decision keeps to it and the elastic controller
    flips on both bounds (`pdserve up`'s defaults where the bench is given none, or a bound of
    0, which no request meets)."""
    extra = ("--transport", args.transport)
    if args.local_prefill_threshold is not None:
        extra += ("--local-prefill-threshold", str(args.local_prefill_threshold))
    for flag, ms in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms),
                     ("--slo-itl-ms", args.slo_itl_ms)):
        if ms:
            extra += (flag, f"{ms:g}")
    return extra


def run_compare_cli(args: argparse.Namespace) -> int:
    s = settings(args)
    results, rounds = run_compare(s)
    print(format_table(results, s.repeats))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        steps_path(args.out).write_text(json.dumps(merge_rounds(rounds)) + "\n")
    if args.plots is not None:
        paths = pictures(results, rounds[-1], args.plots)
        print("pictures: " + ", ".join(str(p) for p in paths))
    return 0 if every_run_completed(results) else 1


def pictures(results: Mapping[str, Mapping[str, Any]], traces: Mapping[str, Any],
             out_dir: Path) -> list[Path]:
    """ttft_cdf.png, itl_cdf.png, timeline.png, and roles.png when a configuration's workers
    changed role during its run."""
    from pdserve.bench.plots import latency_cdfs, role_timeline, step_timeline

    roles = {n: {w: info["roles"] for w, info in results[n].get("workers", {}).items()}
             for n in traces}
    paths = latency_cdfs({n: r["requests"] for n, r in results.items()}, out_dir)
    paths.append(step_timeline(traces, out_dir / "timeline.png", roles=roles))
    flipped = {n: tuple(results[n]["run_window"]) for n in traces if changed_role(results[n])}
    if flipped:
        paths.append(role_timeline(traces, roles, flipped, out_dir / "roles.png"))
    return paths
