"""One whole `pdserve bench chaos` run: start the cluster, load it while the faults land, stop
the load, let the cluster settle, check it still serves, summarize, tear it down.

Lifetime: the cluster (`UpProcess`) lives from `run`'s start to its end, however it ends: an
exception, Ctrl-C, or SIGTERM (turned into KeyboardInterrupt while `main` runs) stops it.
The load stops at `duration_s`; requests in flight then finish within their idle bound, and
any still running after DRAIN_BOUNDS idle bounds is cut off and counted hung. Every fault's
task ends by itself (each waits a bounded time); the settle starts after all of them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

from pdserve.bench.chaos.cli import ChaosSettings
from pdserve.bench.chaos.faults import FaultContext, FaultRecord, inject_at
from pdserve.bench.chaos.load import LoadTarget, RequestResult, client
from pdserve.bench.chaos.report import format_summary, healthy, summarize
from pdserve.bench.chaos.schedule import schedule
from pdserve.bench.chaos.stream import error_message
from pdserve.bench.chaos.workers import Workers
from pdserve.cluster.up_process import UpProcess
from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import resolve_model

DRAIN_BOUNDS = 2
SERVE_WAIT_S = 10.0
SERVE_RETRY_S = 0.5
LOG_TAIL = 60


def model_vocab(model: str) -> int:
    """The vocabulary size of `model` (the cluster has made its folder by now)."""
    return ModelConfig.from_folder(resolve_model(model)).vocab_size


async def drain_clients(clients: list[asyncio.Task], limit_s: float) -> None:
    _, late = await asyncio.wait(clients, timeout=limit_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)


async def _serve_once(session: aiohttp.ClientSession, t: LoadTarget) -> str:
    """'ok' when a short completion succeeds, else what went wrong."""
    body = {"model": t.model, "prompt": "The capital of France is", "max_tokens": 4}
    try:
        async with asyncio.timeout(t.idle_s):
            async with session.post(t.url.rstrip("/") + "/completions", json=body) as resp:
                answer = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok" if resp.status == 200 else f"HTTP {resp.status}: {error_message(answer)}"


async def _served(session: aiohttp.ClientSession, t: LoadTarget) -> str:
    """'ok' once a short completion succeeds within SERVE_WAIT_S (a worker just restarted
    joins the router within a health round or two), else the last failure."""
    deadline = time.monotonic() + SERVE_WAIT_S
    while (answer := await _serve_once(session, t)) != "ok" and time.monotonic() < deadline:
        await asyncio.sleep(SERVE_RETRY_S)
    return answer


async def _load_and_faults(up: UpProcess, s: ChaosSettings, workers: Workers
                           ) -> dict[str, Any]:
    vocab = await asyncio.to_thread(model_vocab, s.model)
    target = LoadTarget(up.url, up.model, vocab, workers.max_model_len - s.max_tokens - 1,
                        s.max_tokens, s.hung_after_s, s.seed)
    stop = asyncio.Event()
    results: list[RequestResult] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        ctx = FaultContext(workers, session, target, s.body_limit, t0, s.duration_s)
        clients = [asyncio.create_task(client(session, target, i, stop, t0, results))
                   for i in range(s.streams)]
        faults = [asyncio.create_task(inject_at(ctx, f))
                  for f in schedule(s.faults, s.duration_s)]
        try:
            await asyncio.sleep(s.duration_s)
            stop.set()
            await drain_clients(clients, DRAIN_BOUNDS * s.hung_after_s)
            records: list[FaultRecord] = await asyncio.gather(*faults)
        finally:
            for task in [*clients, *faults]:
                task.cancel()
            await asyncio.gather(*clients, *faults, return_exceptions=True)
        blocks = await asyncio.to_thread(workers.settle, s.settle_s)
        served = await _served(session, target)
    return summarize(results, records, blocks, served, s.to_json())


def run(s: ChaosSettings) -> dict[str, Any]:
    """Start the cluster, run the load and the faults, summarize; the cluster is stopped on
    the way out. A run that is not `healthy` prints the cluster's last LOG_TAIL lines to
    stderr."""
    up = UpProcess(s.model, *s.up_argv())
    try:
        report = asyncio.run(_load_and_faults(up, s, Workers(up)))
        if not healthy(report):
            print("the cluster's last lines:\n" + "\n".join(list(up.log)[-LOG_TAIL:]),
                  file=sys.stderr, flush=True)
        return report
    finally:
        up.stop()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside (as Ctrl-C does), so the cluster is stopped."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(s: ChaosSettings, as_json: bool) -> int:
    print(f"pdserve bench chaos: {s.streams} streams for {s.duration_s:g} s, faults "
          f"{', '.join(s.faults)}; starting pdserve up {' '.join(s.up_argv())}",
          file=sys.stderr, flush=True)
    try:
        with sigterm_interrupts():
            report = run(s)
    except KeyboardInterrupt:
        print("pdserve bench chaos: interrupted; the cluster is stopped", file=sys.stderr)
        return 130
    if not as_json:
        print(format_summary(report))
    print(json.dumps(report))
    return 0 if healthy(report) else 1
