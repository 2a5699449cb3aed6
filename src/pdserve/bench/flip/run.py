"""One whole `pdserve bench flip` run: start the cluster, take the reference outputs, load it while
one worker flips back and forth, stop the load, wait until the workers hold no KV block,
summarize, tear it down.

Lifetime: the cluster (`UpProcess`, which gives `pdserve up` a fresh secret file and holds the
secret for the signed calls) lives from `run`'s start to its end, however it ends: an
exception, Ctrl-C, or SIGTERM (KeyboardInterrupt while `main` runs) stops it. The load stops
once the last flip's pause ended; requests in flight then finish within their idle bound, and
any still running after DRAIN_BOUNDS idle bounds is cut off and counted hung.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

from pdserve.bench.chaos.load import LoadTarget
from pdserve.bench.chaos.run import (
    DRAIN_BOUNDS,
    LOG_TAIL,
    drain_clients,
    model_vocab,
    sigterm_interrupts,
)
from pdserve.bench.chaos.workers import Workers
from pdserve.bench.flip.cli import FlipSettings
from pdserve.bench.flip.flips import Flipping, FlipRecord, flip_all, flip_target, streams_moved
from pdserve.bench.flip.load import Served, client, references
from pdserve.bench.flip.report import correct, format_summary, progress_line, summarize
from pdserve.cluster.up_process import UpProcess
from pdserve.ctl.cli import FLIP_TIMEOUT_S
from pdserve.ctl.client import CtlError, RouterClient


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _say_tail(up: UpProcess) -> None:
    _say("the cluster's last lines:\n" + "\n".join(list(up.log)[-LOG_TAIL:]))


async def _reference(session: aiohttp.ClientSession, t: LoadTarget, s: FlipSettings
                     ) -> list[str]:
    """Every prompt's text with no flip under way; RuntimeError if one did not end ok."""
    started = time.perf_counter()
    served = await references(session, t, s.prompts, s.streams)
    bad = [r for r in served if not r.ok]
    if bad:
        raise RuntimeError(f"the reference pass failed for {len(bad)} of {s.prompts} prompts; "
                           f"prompt {bad[0].prompt}: {bad[0].outcome.value}: {bad[0].detail}")
    _say(f"reference outputs of {s.prompts} prompts in {time.perf_counter() - started:.1f} s")
    return [r.text for r in served]


async def _load_while_flipping(session: aiohttp.ClientSession, t: LoadTarget,
                               s: FlipSettings, flipping: Flipping,
                               results: list[Served]) -> list[FlipRecord]:
    stop = asyncio.Event()
    clients = [asyncio.create_task(client(session, t, i, s.streams, s.prompts, stop,
                                          flipping.t0, results))
               for i in range(s.streams)]
    try:
        records = await flip_all(flipping, s.flips)
        stop.set()
        await drain_clients(clients, DRAIN_BOUNDS * s.hung_after_s)
    finally:
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    return records


async def _measure(up: UpProcess, s: FlipSettings) -> dict[str, Any]:
    workers = await asyncio.to_thread(Workers, up)
    vocab = await asyncio.to_thread(model_vocab, s.model)
    t = LoadTarget(up.url, up.model, vocab, s.prompt_tokens, s.max_tokens, s.hung_after_s,
                   s.seed)
    router = RouterClient(up.url.removesuffix("/v1"), up.auth, FLIP_TIMEOUT_S)
    target = await asyncio.to_thread(flip_target, router, workers)
    results: list[Served] = []

    def progress(record: FlipRecord, total: int) -> None:
        _say(progress_line(record, total, results))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        reference = await _reference(session, t, s)
        before = await asyncio.to_thread(streams_moved, router.url)
        flipping = Flipping(router, workers, target, s.pause_s, time.perf_counter(), progress)
        records = await _load_while_flipping(session, t, s, flipping, results)
    after = await asyncio.to_thread(streams_moved, router.url)
    moved = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    blocks = await asyncio.to_thread(workers.settle, s.settle_s)
    return summarize(results, reference, records, moved, blocks, s.to_json())


def run(s: FlipSettings) -> dict[str, Any]:
    """Start the cluster, take the references, load and flip, summarize; the cluster is
    stopped on the way out. A run that is not `correct`, or that ends in an error (the
    reference pass failed, the router could not be asked), prints the cluster's last LOG_TAIL
    lines to stderr."""
    up = UpProcess(s.model, *s.up_argv())
    try:
        report = asyncio.run(_measure(up, s))
    except (RuntimeError, CtlError, OSError):
        _say_tail(up)
        raise
    finally:
        up.stop()
    if not correct(report):
        _say_tail(up)
    return report


def main(s: FlipSettings, as_json: bool) -> int:
    _say(f"pdserve bench flip: {s.streams} streams, {s.flips} flips; starting pdserve up "
         f"{' '.join(s.up_argv())}")
    try:
        with sigterm_interrupts():
            report = run(s)
    except KeyboardInterrupt:
        _say("pdserve bench flip: interrupted; the cluster is stopped")
        return 130
    except (RuntimeError, CtlError, OSError) as e:
        _say(f"pdserve bench flip: error: {e}")
        return 1
    if not as_json:
        print(format_summary(report))
    print(json.dumps(report))
    return 0 if correct(report) else 1
