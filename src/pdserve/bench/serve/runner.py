"""`pdserve bench serve`: replay a workload's trace against an OpenAI-compatible server in real
time and report vLLM `bench serve` metrics.

Invariants:
- Open loop (`rate`): request i is sent at t0 + arrival_i (t0 = the loop's start) whatever the
  server does; a late send (the event loop was busy) is sent at once and its real send time is
  what the metrics use.
- Closed loop (`concurrency` = N): N clients, each sending its next request when its previous
  one ended, taking requests in the trace's order (the trace at CLOSED_LOOP_ORDER_RATE; only
  `mixed` depends on it, for where its bursts fall). With a duration, no request starts after
  it; with a count, exactly that many are sent.
- The result is `compute_metrics` (vLLM's keys), then the settings (url, model, workload,
  load, SLOs, timeout), then `requests`: one `request_json` per request, in trace order, with
  its shared prefix's `prefix_id` and `prefix_tokens` when it has one (`prefix` workload).
- Exit status of `run_bench_serve`: 2 for bad arguments, 1 when every request failed, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.bench.serve.client import RequestRecord, completions_url, send_request
from pdserve.bench.serve.metrics import (
    PERCENTILES,
    Slo,
    compute_metrics,
    request_json,
)
from pdserve.bench.serve.workloads import (
    PREFIX_COUNT,
    SMOLLM2_VOCAB,
    WORKLOAD_HELP,
    WORKLOAD_KINDS,
    RequestSpec,
    Workload,
)

CLOSED_LOOP_ORDER_RATE = 1.0
DEFAULT_RATE = 1.0
DEFAULT_DURATION_S = 60.0
Sent = tuple[RequestSpec, RequestRecord]  # a request of the trace and what the client saw
Send = Callable[[RequestSpec], Awaitable[Sent]]


@dataclass(frozen=True)
class Load:
    """How the trace is replayed: open loop at `rate` req/s or closed loop with `concurrency`
    clients (exactly one), for `duration_s` seconds or `num_requests` requests (exactly one)."""

    rate: float | None = None
    concurrency: int | None = None
    duration_s: float | None = None
    num_requests: int | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate (open loop) and concurrency (closed loop)")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration and num_requests")
        _check_positive("rate", self.rate)
        _check_positive("concurrency", self.concurrency)
        _check_positive("duration", self.duration_s)
        _check_positive("num_requests", self.num_requests)

    def settings(self) -> dict[str, Any]:
        return {"request_rate": self.rate, "max_concurrency": self.concurrency,
                "target_duration_s": self.duration_s, "num_prompts": self.num_requests}

    def describe(self) -> str:
        how = (f"open loop, Poisson {self.rate:g} req/s" if self.rate is not None
               else f"closed loop, {self.concurrency} clients")
        until = (f"for {self.duration_s:g} s" if self.duration_s is not None
                 else f"{self.num_requests} requests")
        return f"{how}, {until}"


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0, got {value}")


class _Progress:
    """A tqdm bar on stderr counting finished requests, with ok/failed counts."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="req", desc="bench serve", disable=not enabled,
                        dynamic_ncols=True)
        self.ok = self.failed = 0

    def done(self, record: RequestRecord) -> None:
        if record.ok:
            self.ok += 1
        else:
            self.failed += 1
        self.bar.set_postfix_str(f"ok={self.ok} failed={self.failed}", refresh=False)
        self.bar.update(1)


async def _open_loop(specs: list[RequestSpec], send: Send) -> list[Sent]:
    t0 = time.perf_counter()
    tasks = []
    for spec in specs:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(spec)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(specs: Iterator[RequestSpec], clients: int, duration_s: float | None,
                       send: Send) -> list[Sent]:
    t0 = time.perf_counter()
    numbered = enumerate(specs)  # shared: each client takes the next request of the trace
    records: dict[int, Sent] = {}

    async def client() -> None:
        for i, spec in numbered:
            if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                return
            records[i] = await send(spec)

    await asyncio.gather(*(client() for _ in range(clients)))
    return [records[i] for i in sorted(records)]


def _trace(workload: Workload, load: Load) -> tuple[Iterator[RequestSpec], int | None]:
    """The requests to replay, and their number when known in advance."""
    rate = load.rate if load.rate is not None else CLOSED_LOOP_ORDER_RATE
    if load.concurrency is not None and load.num_requests is None:
        return workload.stream(rate), None
    specs = workload.requests(rate, load.duration_s, load.num_requests)
    return iter(specs), len(specs)


async def run_bench_async(url: str, model: str, workload: Workload, load: Load,
                          timeout_s: float = 300.0, slo: Slo | None = None,
                          progress: bool = True) -> dict[str, Any]:
    """`run_bench` inside a running event loop."""
    _check_positive("timeout", timeout_s)
    endpoint, slo = completions_url(url), slo or Slo()
    specs, total = _trace(workload, load)
    bar = _Progress(total, progress)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def send(spec: RequestSpec) -> Sent:
            record = await send_request(session, endpoint, model, spec, timeout_s)
            bar.done(record)
            return spec, record

        try:
            if load.concurrency is None:
                sent = await _open_loop(list(specs), send)
            else:
                sent = await _closed_loop(specs, load.concurrency, load.duration_s, send)
        finally:
            bar.bar.close()
    settings = {"url": url, "model": model, **workload.settings(), **load.settings(),
                **slo.settings(), "timeout_s": timeout_s}
    records = [record for _, record in sent]
    t0 = min(r.send_s for r in records)
    return {**compute_metrics(records, slo), **settings,
            "requests": [request_json(r, t0) | spec.prefix_fields() for spec, r in sent]}


def run_bench(url: str, model: str, workload: Workload, load: Load, timeout_s: float = 300.0,
              slo: Slo | None = None, progress: bool = True) -> dict[str, Any]:
    """Replay `workload` under `load` against the server at `url` (its root or .../v1) and
    return the metrics dict with the raw per-request records under "requests"."""
    return asyncio.run(run_bench_async(url, model, workload, load, timeout_s, slo, progress))


# ---- command line -----------------------------------------------------------------------------


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps paragraphs, but keeps text with its own line breaks (the workload list) as is."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _workload_epilog() -> str:
    kinds = "".join(f"  {k:<7} {WORKLOAD_HELP[k]}\n" for k in WORKLOAD_KINDS)
    return "workloads (Poisson at --rate, or --concurrency closed-loop clients):\n" + kinds


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """The options of `pdserve bench serve`; the epilog lists the workloads, one a line."""
    parser.formatter_class = _HelpFormatter
    parser.epilog = parser.epilog or _workload_epilog()
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000/v1",
        help="the server's root or its /v1 base URL (default: %(default)s)")
    add("--model", default="smollm2", help="model name sent in each request "
                                           "(default: %(default)s)")
    add("--workload", choices=WORKLOAD_KINDS, default="chat",
        help="the trace shape, listed below (default: %(default)s)")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, default=None,
                      help=f"open loop: Poisson arrivals, requests/s (default: {DEFAULT_RATE:g}"
                           " when --concurrency is not given)")
    loop.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: N clients, each sending its next request when the "
                           "previous one ended")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--duration", type=float, default=None,
                      help=f"seconds of arrivals (default: {DEFAULT_DURATION_S:g})")
    size.add_argument("--num-requests", type=int, default=None,
                      help="the first N requests of the trace instead of a duration")
    add_workload_args(add)
    add("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound in ms")
    add("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound in ms")
    add("--slo-e2e-ms", type=float, default=None, help="goodput: end-to-end bound in ms")
    add("--timeout", type=float, default=300.0,
        help="seconds per request before it counts as failed (default: %(default)s)")
    add("--out", type=Path, default=None,
        help="write the metrics, settings and every request's timings here (JSON)")
    add("--json", action="store_true",
        help="print the metrics and settings as one JSON object instead of the table")


def add_workload_args(add: Callable[..., object]) -> None:
    add("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    add("--vocab", type=int, default=SMOLLM2_VOCAB,
        help="vocabulary size of the model; prompt ids stay below min(vocab, 30000) "
             "(default: %(default)s, SmolLM2)")
    add("--input-len", type=int, default=None, help="fixed workload: prompt tokens")
    add("--output-len", type=int, default=None, help="fixed workload: output tokens")
    add("--burst-every-s", type=float, default=20.0,
        help="mixed workload: seconds between bursts (default: %(default)s)")
    add("--burst-size", type=int, default=4,
        help="mixed workload: long prompts per burst (default: %(default)s)")
    add("--max-model-len", type=int, default=None,
        help="refuse a workload whose prompt + output can exceed this")
    add("--phase-s", type=float, default=60.0,
        help="diurnal workload: seconds of each phase (default: %(default)s)")
    add("--prefixes", type=int, default=PREFIX_COUNT,
        help="prefix workload: shared prefixes the requests start with (default: "
             "%(default)s)")


def settings_from_args(args: argparse.Namespace) -> tuple[Workload, Load, Slo]:
    """Validated settings; ValueError says what to fix."""
    completions_url(args.url)
    workload = Workload(kind=args.workload, seed=args.seed, vocab=args.vocab,
                        input_len=args.input_len, output_len=args.output_len,
                        burst_every_s=args.burst_every_s, burst_size=args.burst_size,
                        max_model_len=args.max_model_len, phase_s=args.phase_s,
                        prefixes=args.prefixes)
    rate = args.rate if args.rate is not None or args.concurrency is not None else DEFAULT_RATE
    duration = (args.duration if args.duration is not None or args.num_requests is not None
                else DEFAULT_DURATION_S)
    load = Load(rate=rate, concurrency=args.concurrency, duration_s=duration,
                num_requests=args.num_requests)
    if workload.kind == "diurnal" and load.rate is None:
        raise ValueError("the diurnal workload switches phases by time: give --rate (open "
                         "loop), not --concurrency")
    _check_positive("timeout", args.timeout)
    if args.out is not None and not args.out.parent.is_dir():
        raise ValueError(f"--out: no directory {args.out.parent}")
    return workload, load, Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)


def run_bench_serve(args: argparse.Namespace) -> int:
    """The `pdserve bench serve` command: run, print the table (or JSON), write --out."""
    try:
        workload, load, slo = settings_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 2
    print(f"pdserve bench serve: {workload.kind} workload (seed {workload.seed}), "
          f"{load.describe()}, against {completions_url(args.url)}", file=sys.stderr, flush=True)
    result = run_bench(args.url, args.model, workload, load, args.timeout, slo)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "requests"}))
    else:
        print(format_summary(result))
    return 1 if result["completed"] == 0 else 0


# ---- the table ------------------------------------------------------------------------------

_WIDTH = 50
_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))


def _row(label: str, value: object) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label + ':':<40} {text}"


def _head_rows(r: dict[str, Any]) -> list[str]:
    rows = [_row("Workload", f"{r['workload']} (seed {r['seed']})"),
            _row("Successful requests", r["completed"]), _row("Failed requests", r["failed"])]
    if r["request_rate"] is not None:
        rows.append(_row("Request rate configured (RPS)", r["request_rate"]))
    if r["max_concurrency"] is not None:
        rows.append(_row("Maximum request concurrency", r["max_concurrency"]))
    rows += [_row("Benchmark duration (s)", r["duration"]),
             _row("Total input tokens", r["total_input_tokens"]),
             _row("Total generated tokens", r["total_output_tokens"]),
             _row("Request throughput (req/s)", r["request_throughput"])]
    if r["request_goodput"] is not None:
        rows.append(_row("Request goodput (req/s)", r["request_goodput"]))
    return rows + [_row("Output token throughput (tok/s)", r["output_throughput"]),
                   _row("Total token throughput (tok/s)", r["total_token_throughput"])]


def _latency_rows(r: dict[str, Any], key: str, short: str, title: str) -> list[str]:
    rows = [f" {title} ".center(_WIDTH, "-"),
            _row(f"Mean {short} (ms)", r[f"mean_{key}_ms"]),
            _row(f"Median {short} (ms)", r[f"median_{key}_ms"])]
    return rows + [_row(f"P{p} {short} (ms)", r[f"p{p}_{key}_ms"]) for p in PERCENTILES]


def format_summary(result: dict[str, Any]) -> str:
    """A vLLM-like table of a `run_bench` result, then its first error messages."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "="), *_head_rows(result)]
    for section in _SECTIONS:
        lines += _latency_rows(result, *section)
    lines.append("=" * _WIDTH)
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)
