"""`pdserve bench compare`: the same trace against several serving configurations, one after
the other, on the same cores, in one run; one table with the ratio to the first.

Each pdserve configuration is started here with `pdserve up` on the first `cores` cores
(collocated: one worker on all of them; disagg: one prefill and one decode worker, the cores
split between them), warmed up with two requests, measured with `bench serve`'s runner, and
stopped before the next starts. Workers keep a ring of their engine steps; the steps of the
measured interval are fetched before the stop (for the timeline picture). `--external
NAME=URL` adds a server someone else started (vLLM, see docs/vllm.md) to the same table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.runner import (
    Load,
    add_workload_args,
    run_bench,
    settings_from_args,
)
from pdserve.bench.serve.workloads import Workload
from pdserve.cluster.up_process import UpProcess, get_json

CONFIGS: dict[str, tuple[str, ...]] = {
    "collocated": ("--collocated", "1"),
    "collocated-chunked": ("--collocated", "1", "--enable-chunked-prefill"),
    "disagg": ("--prefill", "1", "--decode", "1"),
}
EXTERNAL_READY_S = 900.0  # vLLM compiles its model graphs at start-up
TABLE_KEYS = ("completed", "failed", "request_throughput", "output_throughput",
              "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
              "p90_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")


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


    def __post_init__(self) -> None:
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
    def cpus(self) -> str:
        return ",".join(map(str, sorted(os.sched_getaffinity(0))[: self.cores]))


def _warm_up(url: str, model: str, workload: Workload) -> None:
    """Two short requests shaped like the trace's first ones (first-use costs off the clock)."""
    for spec in workload.requests(1.0, num_requests=2):
        body = json.dumps({"model": model, "prompt": list(spec.prompt_token_ids),
                           "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()


def _worker_steps(up: UpProcess, since: float) -> dict[str, list[list[float]]]:
    steps, index, counts = {}, 0, {}
    while True:
        try:
            health = up.health(index)
        except OSError:
            return steps
        role = health["role"]
        name = f"{role}-{counts.get(role, 0)}"
        counts[role] = counts.get(role, 0) + 1
        steps[name] = get_json(f"{up.worker_url(index)}/internal/steps?since={since}")["steps"]
        index += 1


def run_config(s: CompareSettings, name: str) -> tuple[dict[str, Any], dict[str, list]]:
    print(f"== {name}: pdserve up {' '.join(CONFIGS[name])} on cores {s.cpus}", file=sys.stderr,
          flush=True)
    up = UpProcess(s.model, *CONFIGS[name], "--cpus", s.cpus, *s.up_args)
    try:
        _warm_up(up.url, s.model, s.workload)
        since = time.time()
        result = run_bench(up.url, s.model, s.workload, s.load, s.timeout_s, s.slo)
        return result, _worker_steps(up, since)
    finally:
        up.stop()


def run_external(s: CompareSettings, name: str, url: str) -> dict[str, Any]:
    """Bench a server at `url`; if `s.starts` has a command for `name`, start it first (alone
    on the machine, like every pdserve configuration) and stop it afterwards."""
    command = dict(s.starts).get(name)
    print(f"== {name}: external server at {url}" + (f", started with: {command}" if command
                                                      else ""), file=sys.stderr, flush=True)
    if command is None:
        return run_bench(url, s.model, s.workload, s.load, s.timeout_s, s.slo)
    proc = subprocess.Popen(shlex.split(command), start_new_session=True)
    try:
        _wait_ready(url, proc, EXTERNAL_READY_S)
        _warm_up(url, s.model, s.workload)
        return run_bench(url, s.model, s.workload, s.load, s.timeout_s, s.slo)
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


def run_compare(s: CompareSettings) -> tuple[dict[str, dict], dict[str, dict]]:
    """(results by configuration name, worker step traces by configuration name)."""
    results, traces = {}, {}
    for name in s.configs:
        results[name], traces[name] = run_config(s, name)
    for name, url in s.externals:
        results[name] = run_external(s, name, url)
    return results, traces


def format_table(results: dict[str, dict[str, Any]]) -> str:
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
    return "\n".join(lines)


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
                   help="KV transport of the disagg configuration (default: %(default)s)")
    p.add_argument("--local-prefill-threshold", type=int, default=None, metavar="TOKENS",
                   help="disagg: prompts up to this many uncached tokens run whole on the "
                        "decode worker (default: pdserve up's)")
    p.add_argument("--workload", default="mixed", choices=["chat", "rag", "mixed", "fixed"],
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
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON: one object per configuration, keyed by its name, with the same "
                        "metric names as `bench serve` (and every request's timings)")
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
        timeout_s=args.timeout, up_args=_up_args(args), starts=starts)


def _pairs(items: list[str], option: str, shape: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{option} wants {shape}, got {item!r}")
        pairs.append((name, value))
    return tuple(pairs)


def _up_args(args: argparse.Namespace) -> tuple[str, ...]:
    extra = ("--transport", args.transport)
    if args.local_prefill_threshold is not None:
        extra += ("--local-prefill-threshold", str(args.local_prefill_threshold))
    return extra


def run_compare_cli(args: argparse.Namespace) -> int:
    s = settings(args)
    results, traces = run_compare(s)
    print(format_table(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".steps.json").write_text(json.dumps(traces) + "\n")
    if args.plots is not None:
        from pdserve.bench.plots import latency_cdfs, step_timeline

        paths = latency_cdfs({n: r["requests"] for n, r in results.items()}, args.plots)
        paths.append(step_timeline(traces, args.plots / "timeline.png"))
        print("pictures: " + ", ".join(str(p) for p in paths))
    return 0 if all(r["completed"] for r in results.values()) else 1
