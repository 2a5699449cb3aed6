"""`pdserve bench router`: what the router adds, measured against the same worker addressed
directly, in the same run.

One `pdserve up --collocated 1` (the worker pinned to one core, the router and the clients on
the other; the worker takes up to twice the highest concurrency in one step). For each
concurrency level, closed-loop streaming clients send the same completion requests to the
worker's own OpenAI endpoint and to the router. Request i of a run has a seeded prompt length
and max_tokens drawn around the settings' values, and at more than one stream a run has at
least `WAVES` requests per stream: with equal requests, 64 streams would start, finish and
restart in lockstep, and each run would measure how one burst happened to fall into the
scheduler's steps.
- added latency: at one stream, requests alternate direct / router (every other pair the
  router's first; each path's client keeps its connection) and the added latency is the median
  of the pairs' differences (a drift of the engine's step time, on a shared machine often
  larger than the router's cost, cancels within a pair). At c streams, c streams through the
  router and c direct run at once, so both paths' requests share every engine step, and it is
  again the median of the pairs' differences: request i of each path (the same body, started
  at about the same time), so neither the step drift nor the mix of request lengths enters it
  (the difference of the two medians, compared requests of other lengths: +-10 ms from run to
  run). (Runs of each path in turn, the design before, differed by the step-time drift between
  runs: -24 to +77 ms at 64 streams, hiding what the router adds.) End-to-end and time-to-
  first-token alike;
- in-process added: the router's own e2e (request arrival -> last byte) minus the worker's
  (leg submitted -> last token), means over a router-only run (c streams; 32 requests at one
  stream): both contain the same engine steps, so the step noise cancels. An upper bound on
  what the router adds, without the client <-> router hop: it also counts the worker's HTTP
  thread taking the leg and sending its tokens on the engine's core.
- router CPU per relayed token: the router process's CPU time over that router-only run (its
  threads' /proc schedstat, else /proc/PID/stat) divided by the tokens it streamed, against
  the worker's mean decode step in the same run (its `pdserve_engine_step_seconds` sum and
  count).
- what authentication and limits cost: the router's access middleware (an API key checked and
  a token taken from a bucket that never runs dry) timed in this process on mocked requests,
  CPU per request minus the same loop calling the handler directly, against the router's CPU
  per request in the router-only run (CPU per token x tokens per request). A router started
  with a key beside a plain one cannot show it: two identical routers differed by 6% in CPU
  per token at 64 streams (107.6 and 114.5 us), the key's router by 7% more.
Medians over `repeats`; the machine should be otherwise idle.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pdserve.bearer import KeySet
from pdserve.cluster.up_process import UpProcess
from pdserve.router.access import AccessSettings, access_middleware
from pdserve.router.rate_limit import RateLimit

CLK_TCK = os.sysconf("SC_CLK_TCK")
WAVES = 8
BENCH_KEY = "pdserve-bench-router-api-key"
AUTH_CALLS = 20_000


@dataclass(frozen=True)
class RouterBenchSettings:
    model: str = "smollm2"
    device: str = "cpu"
    concurrency: tuple[int, ...] = (1, 64)
    requests: int = 64  # per run and level (at least the concurrency)
    max_tokens: int = 16
    prompt_words: int = 32
    repeats: int = 3

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be >= 1")
        for name in ("requests", "max_tokens", "prompt_words", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class RunStats:
    e2e: list[float]  # seconds, by request index
    ttft: list[float]
    tokens: int

    @classmethod
    def of_size(cls, n: int) -> RunStats:
        """For a run of n requests, each time NaN until its request ends."""
        return cls([math.nan] * n, [math.nan] * n, 0)


def run_size(s: RouterBenchSettings, concurrency: int) -> int:
    """Requests per run: `s.requests`, and at more than one stream at least `WAVES` per stream,
    so that the closed loop reaches its steady state (the first wave starts all at once)."""
    return s.requests if concurrency == 1 else max(s.requests, WAVES * concurrency)


def _bodies(model: str, s: RouterBenchSettings, n: int) -> list[dict]:
    """Request i of every run: prompt and max_tokens drawn around the settings' values
    (seeded, the same for both paths), so that closed-loop streams drift apart instead of
    starting and ending in lockstep waves."""
    rng = random.Random(0)
    return [{"model": model, "prompt": "word " * rng.randint(1 + s.prompt_words // 2,
                                                             s.prompt_words * 3 // 2),
             "max_tokens": rng.randint(1 + s.max_tokens // 2, s.max_tokens * 3 // 2),
             "temperature": 0, "ignore_eos": True, "stream": True} for _ in range(n)]


async def _one(session: aiohttp.ClientSession, url: str, body: dict, stats: RunStats,
               i: int) -> None:
    """Request i of the run: its times go to position i (the paths' request i are pairs)."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                    stats.tokens += 1
                    first = first or time.perf_counter()
    stats.e2e[i] = time.perf_counter() - t0
    stats.ttft[i] = (first or time.perf_counter()) - t0


async def _load(url: str, model: str, s: RouterBenchSettings, concurrency: int,
                headers: dict[str, str] | None = None) -> RunStats:
    n = run_size(s, concurrency)
    stats = RunStats.of_size(n)
    todo = iter(enumerate(_bodies(model, s, n)))

    async def client(session: aiohttp.ClientSession) -> None:
        for i, body in todo:
            await _one(session, url, body, stats, i)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return stats


def _cpu_seconds(pid: int) -> float:
    """CPU time of all the process's threads: nanoseconds from schedstat where the kernel has
    it, else utime + stime in clock ticks (10 ms: coarse against a run's few ms per request)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return sum(_schedstat_ns(pid, tid) for tid in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (proc(5) 14, 15)


def _schedstat_ns(pid: int, tid: str) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])  # time spent on the CPU (proc(5) schedstat)


def _histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on a pdserve /metrics page."""
    import urllib.request

    total = count = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"{name}_sum "):
                total = float(line.split()[1])
            elif line.startswith(f"{name}_count "):
                count = float(line.split()[1])
    return total, count


def _step_totals(worker_url: str) -> tuple[float, float]:
    return _histogram_totals(worker_url, "pdserve_engine_step_seconds")


def _e2e_totals(worker_url: str, router_url: str) -> tuple[tuple[float, float], ...]:
    return (_histogram_totals(router_url, "pdserve_router_e2e_request_latency_seconds"),
            _histogram_totals(worker_url, "pdserve_e2e_request_latency_seconds"))


def _in_process_added(before: tuple, after: tuple) -> float:
    """Mean e2e in the router (request arrival -> last byte sent) minus mean e2e in the worker
    (leg submitted -> last token) over a router-only run: what the router adds, timed by the
    processes themselves, so the engine's step time (the same in both) cancels. An upper
    bound: it counts the router's parse and tokenize, which the direct path does on the
    worker before its own clock starts."""
    (r0, w0), (r1, w1) = before, after
    return _histogram_mean(r0, r1) - _histogram_mean(w0, w1)


def _histogram_mean(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Mean of what a histogram observed between two (sum, count) readings."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1)


def _router_pid(up: UpProcess) -> int:
    for pid in up.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"router" in argv and b"pdserve.cli" in argv:
            return pid
    raise RuntimeError("cannot find the router process of pdserve up")


async def _paired(direct: str, router: str, model: str, s: RouterBenchSettings
                  ) -> tuple[RunStats, RunStats]:
    """One stream, requests alternating direct and via the router: run i of each is pair i.
    Every other pair sends its router request first. With the direct one always first, the
    router's tokens fell ~0.1 ms further behind with each token (+0.8 ms at token 1, +2.9 ms
    at token 20, 40 pairs); alternating the order, +0.8 and +1.2 ms: an order effect, which
    now falls on both paths alike. Pair i sends request i of the run to both paths, and each
    path's client keeps its connection open across requests, as the openai client and the
    c-stream runs do (a new connection per request cost the router path ~0.3 ms more than the
    direct one: accepting it shares the router's core with the client)."""
    bodies = _bodies(model, s, s.requests)
    pair = (RunStats.of_size(s.requests), RunStats.of_size(s.requests))
    async with aiohttp.ClientSession() as d, aiohttp.ClientSession() as r:
        paths = list(zip(((d, direct), (r, router)), pair, strict=True))
        for i, body in enumerate(bodies):
            for (session, url), stats in (paths if i % 2 == 0 else paths[::-1]):
                await _one(session, url, body, stats, i)
    return pair


@dataclass(frozen=True)
class _Cluster:
    worker: str  # base URLs
    router: str
    router_pid: int


def measure(s: RouterBenchSettings) -> Iterator[dict]:
    """One row per concurrency level, each as soon as it is measured."""
    cores = sorted(os.sched_getaffinity(0))
    # --serve-public: the direct path is the worker's own /v1
    up = UpProcess(s.model, "--collocated", "1", "--cpus", str(cores[0]), "--device", s.device,
                   "--max-num-seqs", str(2 * max(s.concurrency)), "--serve-public")
    try:
        at = _Cluster(up.worker_url(0), up.url.removesuffix("/v1"), _router_pid(up))
        asyncio.run(_load(at.router + "/v1", s.model, s, 4))  # warm-up both paths
        for c in s.concurrency:
            yield _level(at, s, c)
    finally:
        up.stop()


def _level(at: _Cluster, s: RouterBenchSettings, c: int) -> dict:
    runs: dict[str, list[RunStats]] = {"direct": [], "router": []}
    alone: list[tuple[float, float, float]] = []
    auth_s: list[float] = []
    alone_s = s if c > 1 else replace(s, requests=32)
    for _ in range(s.repeats):
        if c == 1:
            direct, routed = asyncio.run(_paired(at.worker + "/v1", at.router + "/v1",
                                                 s.model, s))
        else:
            direct, routed = asyncio.run(_together(at, s, c))
        runs["direct"].append(direct)
        runs["router"].append(routed)
        alone.append(_router_alone(at, alone_s, c))
        auth_s.append(auth_check_seconds())
    cpu_per_token, steps, in_process, tokens = (list(x) for x in zip(*alone, strict=True))
    return _row(c, runs, cpu_per_token, steps, in_process, (auth_s, tokens))


def auth_check_seconds(calls: int = AUTH_CALLS) -> float:
    """CPU seconds the router's access middleware adds to one request: a valid API key and a
    token from a bucket that never runs dry (every request pays both checks in full), timed on
    a mocked request against the same loop calling the handler directly, in alternating rounds
    (medians)."""
    access = AccessSettings(KeySet([BENCH_KEY]), None, RateLimit.of(1e9, None))
    guard, answer = access_middleware(access), web.Response()
    request = make_mocked_request("POST", "/v1/completions",
                                  headers={"Authorization": f"Bearer {BENCH_KEY}"})

    async def handler(_: web.Request) -> web.StreamResponse:
        return answer

    async def accepted() -> bool:
        return await guard(request, handler) is answer

    if not asyncio.run(accepted()):
        raise RuntimeError("the access check refused the bench's key: it would time a refusal")

    async def loop(guarded: bool) -> float:
        t0 = time.process_time()
        for _ in range(calls):
            await (guard(request, handler) if guarded else handler(request))
        return (time.process_time() - t0) / calls

    async def rounds() -> float:
        with_guard, without = [], []
        for _ in range(5):
            with_guard.append(await loop(True))
            without.append(await loop(False))
        return statistics.median(with_guard) - statistics.median(without)

    return asyncio.run(rounds())


async def _together(at: _Cluster, s: RouterBenchSettings, c: int) -> tuple[RunStats, RunStats]:
    """c streams direct and c through the router at once: every step holds both."""
    direct, routed = await asyncio.gather(_load(at.worker + "/v1", s.model, s, c),
                                          _load(at.router + "/v1", s.model, s, c))
    return direct, routed


def _router_alone(at: _Cluster, s: RouterBenchSettings, c: int
                  ) -> tuple[float, float, float, float]:
    """(router CPU seconds per relayed token, the worker's mean step, in-process added, tokens
    per request) over a run through the router alone."""
    cpu0, steps0, e2e0 = _cpu_seconds(at.router_pid), _step_totals(at.worker), \
        _e2e_totals(at.worker, at.router)
    run = asyncio.run(_load(at.router + "/v1", s.model, s, c))
    cpu = (_cpu_seconds(at.router_pid) - cpu0) / max(run.tokens, 1)
    return (cpu, _histogram_mean(steps0, _step_totals(at.worker)),
            _in_process_added(e2e0, _e2e_totals(at.worker, at.router)),
            run.tokens / len(run.e2e))


def _row(c: int, runs: dict[str, list[RunStats]], cpu_per_token: list[float],
         steps: list[float], in_process: list[float],
         auth: tuple[list[float], list[float]] | None = None) -> dict:
    """`runs`: each repeat's direct and router stats from the same run, request i of one path
    paired with request i of the other (the same body; at one stream sent one after the
    other, above at about the same time); `steps`: the worker's mean step in each
    router-only run."""
    def med(path: str, attr: str) -> float:
        return statistics.median(statistics.median(getattr(r, attr)) for r in runs[path])

    def added(attr: str) -> float:  # the median pair difference of each run, then of runs
        return statistics.median(
            statistics.median(x - y for x, y in zip(getattr(r, attr), getattr(d, attr),
                                                    strict=True))
            for r, d in zip(runs["router"], runs["direct"], strict=True))

    step = statistics.median(steps)
    cpu = statistics.median(cpu_per_token)
    """`auth`: each repeat's access-check seconds per request and tokens per request."""
    check, tokens = (statistics.median(x) for x in auth) if auth else (math.nan, math.nan)
    return {
        "concurrency": c,
        "direct_e2e_p50_ms": 1e3 * med("direct", "e2e"),
        "router_e2e_p50_ms": 1e3 * med("router", "e2e"),
        "added_e2e_p50_ms": 1e3 * added("e2e"),
        "direct_ttft_p50_ms": 1e3 * med("direct", "ttft"),
        "router_ttft_p50_ms": 1e3 * med("router", "ttft"),
        "added_ttft_p50_ms": 1e3 * added("ttft"),
        "in_process_added_mean_ms": 1e3 * statistics.median(in_process),
        "router_cpu_us_per_token": 1e6 * cpu,
        "decode_step_ms": 1e3 * step,
        "router_cpu_per_token_over_step": cpu / step if step else float("nan"),
        "auth_check_us_per_request": 1e6 * check,
        "auth_cost_of_router_cpu": check / (cpu * tokens) if cpu else float("nan"),
    }


def main(s: RouterBenchSettings, as_json: bool) -> int:
    sizes = ", ".join(f"{run_size(s, c)} at {c}" for c in s.concurrency)
    print(f"pdserve bench router: {s.model}, streamed requests per run: {sizes}; prompts "
          f"~{s.prompt_words} words, ~{s.max_tokens} tokens each; medians of {s.repeats} "
          f"runs, worker on {s.device}, pinned to one core", flush=True)
    if as_json:
        for row in measure(s):
            print(json.dumps(row), flush=True)
        return 0
    print(f"{'streams':>7} {'direct e2e':>11} {'router e2e':>11} {'added':>9} "
          f"{'added TTFT':>11} {'router CPU/tok':>15} {'step':>10} "
          f"{'CPU/tok / step':>15} {'in-process added':>17} {'key+limit/req':>14} "
          f"{'of router CPU':>14}", flush=True)
    for r in measure(s):
        print(f"{r['concurrency']:>7} {r['direct_e2e_p50_ms']:>9.2f}ms "
              f"{r['router_e2e_p50_ms']:>9.2f}ms {r['added_e2e_p50_ms']:>7.2f}ms "
              f"{r['added_ttft_p50_ms']:>9.2f}ms {r['router_cpu_us_per_token']:>12.1f} us "
              f"{r['decode_step_ms']:>8.2f}ms "
              f"{100 * r['router_cpu_per_token_over_step']:>14.2f}% "
              f"{r['in_process_added_mean_ms']:>15.2f}ms "
              f"{r['auth_check_us_per_request']:>11.2f} us "
              f"{100 * r['auth_cost_of_router_cpu']:>13.3f}%", flush=True)
    return 0
