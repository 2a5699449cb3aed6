"""`pdserve bench hostile`: how long one hostile request holds up everyone else's tokens.

One `pdserve up` (its default layout unless `--up-args` says otherwise). `streams` closed-loop
clients stream long greedy completions through the router the whole time and timestamp every
token. Every `period_s`, one hostile request goes to the router: a completion whose JSON body
is `body_mb` MiB of prompt: text (`kind` "text", the kind of body that froze the router's
event loop for seconds when parsing and tokenizing ran on it) or token ids ("ids": the
costliest JSON to parse per byte). The baseline is measured in the same run:
the inter-token gaps of the same streams outside the hostile requests.

- hostile gaps: the gaps between consecutive tokens of a stream that overlap a hostile
  request's lifetime (sent -> answered), by their end time;
- baseline gaps: the gaps that start and end at least `GUARD_S` away from any hostile request;
- added P99: P99 of hostile gaps minus P99 of baseline gaps, what a hostile request adds to a
  stream's worst-case wait for its next token.
Medians over `repeats` runs (each a fresh `pdserve up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import time
from dataclasses import dataclass

import aiohttp

from pdserve.bench.serve.client import RequestRecord, completions_url, send_request
from pdserve.bench.serve.metrics import percentile
from pdserve.bench.serve.workloads import RequestSpec
from pdserve.cluster.up_process import UpProcess

GUARD_S = 0.2
WARMUP_S = 3.0
STREAM_PROMPT = tuple(range(100, 132))  # 32 token ids: short, so the decode worker runs it
KINDS = ("text", "ids")


@dataclass(frozen=True)
class HostileBenchSettings:
    model: str = "smollm2"
    streams: int = 8
    body_mb: float = 10.0
    kind: str = "text"  # "text" | "ids"
    rounds: int = 5  # hostile requests per run
    period_s: float = 3.0  # between hostile requests
    max_tokens: int = 512  # per stream request (ignore_eos): long, so streams stay mid-flight
    repeats: int = 3
    up_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("streams", "rounds", "max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.body_mb > 0 or not self.period_s > 2 * GUARD_S:
            raise ValueError(f"body_mb must be > 0 and period_s > {2 * GUARD_S} s")


@dataclass(frozen=True)
class Hostile:
    sent_s: float
    done_s: float
    status: int


def hostile_body(model: str, mib: float, kind: str = "text") -> bytes:
    """A completion request whose prompt (text, or token ids) makes the JSON body `mib` MiB."""
    if kind == "ids":
        prompt: str | list[int] = [1000 + i % 9000 for i in range(int(mib * 2**20 / 6))]
    else:
        prompt = "lorem ipsum " * int(mib * 2**20 / 12)
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()


def gaps(records: list[RequestRecord]) -> list[tuple[float, float]]:
    """(start, end) of every gap between consecutive tokens of one request."""
    return [(a, b) for r in records for a, b in itertools.pairwise(r.token_times_s)]


def split_gaps(all_gaps: list[tuple[float, float]], hostile: list[Hostile]
               ) -> tuple[list[float], list[float]]:
    """(gaps overlapping a hostile request, gaps clear of every hostile request by GUARD_S),
    in seconds."""
    during, clear = [], []
    for a, b in all_gaps:
        if any(a < h.done_s and b > h.sent_s for h in hostile):
            during.append(b - a)
        elif all(b < h.sent_s - GUARD_S or a > h.done_s + GUARD_S for h in hostile):
            clear.append(b - a)
    return during, clear


async def _stream(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int,
                  stop: asyncio.Event, out: list[RequestRecord]) -> None:
    spec = RequestSpec(0.0, STREAM_PROMPT, max_tokens)
    while not stop.is_set():
        out.append(await send_request(session, url, model, spec, timeout_s=600))


async def _hostile(session: aiohttp.ClientSession, url: str, body: bytes) -> Hostile:
    sent = time.perf_counter()
    async with session.post(url, data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        return Hostile(sent, time.perf_counter(), resp.status)


async def _run(url: str, s: HostileBenchSettings) -> tuple[list[RequestRecord], list[Hostile]]:
    body, stop, records = hostile_body(s.model, s.body_mb, s.kind), asyncio.Event(), []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = [asyncio.create_task(_stream(session, url, s.model, s.max_tokens, stop,
                                               records)) for _ in range(s.streams)]
        await asyncio.sleep(WARMUP_S)
        hostile = []
        for _ in range(s.rounds):
            await asyncio.sleep(s.period_s / 2)
            hostile.append(await _hostile(session, url, body))
            await asyncio.sleep(s.period_s / 2)
        stop.set()
        for task in streams:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*streams, return_exceptions=True)
    return records, hostile


def measure(s: HostileBenchSettings) -> dict[str, float]:
    up = UpProcess(s.model, *s.up_args)
    try:
        records, hostile = asyncio.run(_run(completions_url(up.url), s))
    finally:
        up.stop()
    during, clear = split_gaps(gaps(records), hostile)
    if not during or not clear:
        raise RuntimeError("no token gaps measured: are the streams running?")
    return {"p99_gap_during_ms": 1e3 * percentile(during, 99),
            "max_gap_during_ms": 1e3 * max(during),
            "p99_gap_baseline_ms": 1e3 * percentile(clear, 99),
            "p50_gap_baseline_ms": 1e3 * percentile(clear, 50),
            "added_p99_ms": 1e3 * (percentile(during, 99) - percentile(clear, 99)),
            "hostile_ms": 1e3 * statistics.median(h.done_s - h.sent_s for h in hostile),
            "hostile_status": float(statistics.mode(h.status for h in hostile)),
            "failed_streams": float(sum(not r.ok for r in records))}


def main(s: HostileBenchSettings, as_json: bool) -> int:
    runs = []
    for i in range(s.repeats):
        runs.append(measure(s))
        print(f"run {i + 1}/{s.repeats}: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                      runs[-1].items()), flush=True)
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if as_json:
        print(json.dumps({"settings": s.__dict__ | {"up_args": list(s.up_args)},
                          "median": medians, "runs": runs}))
        return 0
    print(f"{s.streams} streams, one {s.body_mb:g} MiB body ({s.kind}) every {s.period_s:g} s, "
          f"{s.rounds} per run, medians of {s.repeats} runs:")
    print(f"  inter-token gap P99 during a hostile request {medians['p99_gap_during_ms']:.1f} ms"
          f" (max {medians['max_gap_during_ms']:.1f}), baseline P99 "
          f"{medians['p99_gap_baseline_ms']:.1f} ms (P50 {medians['p50_gap_baseline_ms']:.1f})")
    print(f"  added P99 {medians['added_p99_ms']:+.1f} ms; the hostile request was answered "
          f"{int(medians['hostile_status'])} in {medians['hostile_ms']:.1f} ms; "
          f"{int(medians['failed_streams'])} stream requests failed")
    return 0
