"""One injection per fault kind of `pdserve bench chaos`, and the record of what it did.

Every injection is bounded: it waits for its target worker to answer (one just killed may be
restarting) until the load ends at the latest, waits at most RESTART_WAIT_S for a killed or
stopped worker to answer again, and returns a `FaultRecord` whose `at_s` is the moment the fault
hit (seconds since the load started; for a client-gone fault, when its client closed).
`promised` says whether the outcome is what pdserve promises for that fault: a killed worker
comes back, a stopped one answers again after SIGCONT, a forged KV handshake or write is
refused, an oversized body gets 413 (a client that goes away is always as promised here: what
it must leave behind, no KV block held, is checked when the run settles). A fault with no
target (no worker of that role, or none answering before the load ended) is not injected. A
SIGSTOPped worker always gets its SIGCONT, also when the run is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.chaos import kv_probe
from pdserve.bench.chaos.load import LONG_TOKENS, LoadTarget, RequestShape, request
from pdserve.bench.chaos.schedule import ScheduledFault
from pdserve.bench.chaos.stream import SseReader, http_error
from pdserve.bench.chaos.workers import Worker, Workers

RESTART_WAIT_S = 120.0
STOP_S = 3.0
PREFILL_GONE_S = 0.3  # client-gone-prefill closes this long after sending, if no token came
STREAM_GONE_TOKENS = 4  # client-gone-stream closes after this many tokens
GONE_RETRY_S = 0.5
OVERSIZE_MARGIN = 2**20


@dataclass(frozen=True)
class FaultRecord:
    kind: str
    at_s: float
    target: str
    outcome: str
    injected: bool = True
    promised: bool = True

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "at_s": round(self.at_s, 3), "target": self.target,
                "outcome": self.outcome, "injected": self.injected, "promised": self.promised}


@dataclass
class FaultContext:
    """What injections share over one run; `t0` is the load's start (perf_counter)."""

    workers: Workers
    session: aiohttp.ClientSession
    target: LoadTarget
    body_limit: int  # the router's --max-body-size, bytes
    t0: float
    load_end_s: float  # no fault is injected after the load ended
    stop_turn: list[str] = field(default_factory=lambda: ["decode", "prefill"])
    kv_turn: list[str] = field(default_factory=lambda: ["prefill", "decode"])

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def left_s(self) -> float:
        """Seconds until the load ends (0 after)."""
        return max(0.0, self.load_end_s - self.now())

    def skipped(self, kind: str, why: str) -> FaultRecord:
        return FaultRecord(kind, self.now(), "-", why, injected=False, promised=True)

    def turn(self, roles: list[str]) -> str:
        """The next role of `roles` in turn (collocated clusters have only collocated)."""
        roles.append(roles.pop(0))
        return roles[-1]


async def _live(ctx: FaultContext, role: str) -> tuple[Worker, dict] | str:
    """A worker of `role` in turn and its /health once it answers; else why not."""
    w = ctx.workers.next_of(role) or ctx.workers.next_of("collocated")
    if w is None:
        return f"no {role} worker"
    info = await asyncio.to_thread(ctx.workers.wait_health, w, ctx.left_s())
    if info is None:
        return f"{w.name} did not answer before the load ended"
    return w, info


async def kill9(ctx: FaultContext, kind: str, role: str) -> FaultRecord:
    found = await _live(ctx, role)
    if isinstance(found, str):
        return ctx.skipped(kind, found)
    w, info = found
    at = ctx.now()
    os.kill(info["pid"], signal.SIGKILL)
    back = await asyncio.to_thread(ctx.workers.wait_health, w, RESTART_WAIT_S, info["pid"])
    if back is None:
        return FaultRecord(kind, at, w.label(info["pid"]),
                           f"not back within {RESTART_WAIT_S:g} s", promised=False)
    return FaultRecord(kind, at, w.label(info["pid"]),
                       f"restarted as pid {back['pid']}, answering after {ctx.now() - at:.1f} s")


async def stop_cont(ctx: FaultContext, kind: str) -> FaultRecord:
    found = await _live(ctx, ctx.turn(ctx.stop_turn))
    if isinstance(found, str):
        return ctx.skipped(kind, found)
    w, info = found
    at = ctx.now()
    os.kill(info["pid"], signal.SIGSTOP)
    try:
        await asyncio.sleep(STOP_S)
    finally:
        os.kill(info["pid"], signal.SIGCONT)
    woke = ctx.now()
    back = await asyncio.to_thread(ctx.workers.wait_health, w, RESTART_WAIT_S)
    if back is None or back["pid"] != info["pid"]:
        return FaultRecord(kind, at, w.label(info["pid"]), "did not answer /health after "
                           "SIGCONT" if back is None else "was restarted", promised=False)
    return FaultRecord(kind, at, w.label(info["pid"]), f"stopped {STOP_S:g} s; answered "
                       f"/health {ctx.now() - woke:.1f} s after SIGCONT")


@dataclass(frozen=True)
class _Gone:
    closed: bool  # the client closed where it meant to (else the request ended first)
    at_s: float  # when it closed, or when the request ended
    what: str
    retry: bool = False  # not closed, but worth sending again (a 5xx, a failed connection)


async def _gone_client(ctx: FaultContext, shape: RequestShape, tokens: int,
                       after_s: float | None) -> _Gone:
    """A streamed request that closes its connection after `tokens` tokens, or `after_s`
    seconds without them."""
    url, body = request(ctx.target, shape, random.Random())
    reader, sent = SseReader(), ctx.now()
    try:
        async with asyncio.timeout(after_s if after_s is not None else ctx.target.idle_s):
            async with ctx.session.post(url, json=body) as resp:
                if resp.status != 200:
                    return _Gone(False, ctx.now(), http_error(resp.status, await resp.text()),
                                 retry=resp.status >= 500)
                async for line in resp.content:
                    reader.feed(line, ctx.now())
                    if len(reader.token_times_s) >= tokens or reader.finished:
                        break
                resp.close()
    except TimeoutError:  # at `after_s` the client means to close; at the idle bound, not
        return _Gone(after_s is not None, ctx.now(), f"closed {ctx.now() - sent:.2f} s after "
                     f"sending, after {len(reader.token_times_s)} tokens")
    except (aiohttp.ClientError, OSError) as e:
        return _Gone(False, ctx.now(), f"connection failed: {type(e).__name__}: {e}", True)
    if len(reader.token_times_s) < tokens:
        return _Gone(False, ctx.now(), f"the stream ended after {len(reader.token_times_s)} "
                                       f"tokens: {reader.error or 'no error event'}",
                     retry=reader.error is not None)
    return _Gone(True, ctx.now(), f"closed after {len(reader.token_times_s)} tokens, "
                                  f"{ctx.now() - sent:.2f} s after sending")


async def client_gone(ctx: FaultContext, kind: str) -> FaultRecord:
    """Sends the request again (every GONE_RETRY_S, until the load ends) while it fails
    with a server error before the client gets to close where it means to: such a request
    (the cluster is recovering from an earlier fault) is not this fault."""
    cap, most = ctx.target.prompt_cap, ctx.target.max_tokens
    long = min(LONG_TOKENS, cap)
    shape, tokens, after_s = {
        "client-gone-prefill": (RequestShape("long", long, most), 1, PREFILL_GONE_S),
        "client-gone-transfer": (RequestShape("long", long, most), 1, None),
        "client-gone-stream": (RequestShape("short", min(64, cap), most), STREAM_GONE_TOKENS,
                               None),
    }[kind]
    target = f"router ({shape.prompt_tokens}-token prompt)"
    failures: list[str] = []
    while not (gone := await _gone_client(ctx, shape, tokens, after_s)).closed:
        failures.append(gone.what)
        if not gone.retry or ctx.left_s() == 0:
            return FaultRecord(kind, gone.at_s, target, f"never got to close in "
                               f"{len(failures)} tries; last: {gone.what}", injected=False)
        await asyncio.sleep(GONE_RETRY_S)
    tried = f" (after {len(failures)} failed tries; first: {failures[0]})" if failures else ""
    return FaultRecord(kind, gone.at_s, target, gone.what + tried)


async def corrupt_kv(ctx: FaultContext, kind: str) -> FaultRecord:
    found = await _live(ctx, ctx.turn(ctx.kv_turn))
    if isinstance(found, str):
        return ctx.skipped(kind, found)
    w, info = found
    peer = info.get("peer")
    if not isinstance(peer, dict) or "port" not in peer:
        return ctx.skipped(kind, f"{w.name} has no KV endpoint")
    at, target = ctx.now(), f"{w.name} KV {peer['host']}:{peer['port']}"
    hello = await asyncio.to_thread(kv_probe.probe, peer["host"], peer["port"],
                                    kv_probe.forged_hello(peer))
    write = await asyncio.to_thread(kv_probe.probe, peer["host"], peer["port"],
                                    kv_probe.bare_write())
    return FaultRecord(kind, at, target, f"forged HELLO: {hello[1]}; bare WRITE: {write[1]}",
                       promised=hello[0] and write[0])


def oversized_body(model: str, size: int) -> bytes:
    """A completion request of exactly `size` bytes (a long text prompt)."""
    head, tail = json.dumps({"model": model, "prompt": ""})[:-2], '"}'
    return (head + "x" * (size - len(head) - len(tail)) + tail).encode()


async def oversized(ctx: FaultContext, kind: str) -> FaultRecord:
    size = ctx.body_limit + OVERSIZE_MARGIN
    body = oversized_body(ctx.target.model, size)
    at, sent = ctx.now(), time.perf_counter()
    target = f"router ({size} bytes, limit {ctx.body_limit})"
    try:
        async with asyncio.timeout(ctx.target.idle_s):
            async with ctx.session.post(ctx.target.url.rstrip("/") + "/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                text = await resp.text(errors="replace")
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return FaultRecord(kind, at, target, f"no answer: {type(e).__name__}: {e}",
                           promised=False)
    took = f"{1e3 * (time.perf_counter() - sent):.0f} ms"
    return FaultRecord(kind, at, target, f"{http_error(resp.status, text)} in {took}",
                       promised=resp.status == 413)


Inject = Callable[[FaultContext, str], Awaitable[FaultRecord]]
INJECT: dict[str, Inject] = {
    "kill9-prefill": lambda ctx, kind: kill9(ctx, kind, "prefill"),
    "kill9-decode": lambda ctx, kind: kill9(ctx, kind, "decode"),
    "stop-cont": stop_cont,
    "client-gone-prefill": client_gone,
    "client-gone-transfer": client_gone,
    "client-gone-stream": client_gone,
    "corrupt-kv": corrupt_kv,
    "oversized-body": oversized,
}


async def inject_at(ctx: FaultContext, fault: ScheduledFault) -> FaultRecord:
    """Wait until `fault.at_s`, inject it and return its record; an injection that raises is
    recorded as not injected, with the exception."""
    await asyncio.sleep(max(0.0, fault.at_s - ctx.now()))
    try:
        return await INJECT[fault.kind](ctx, fault.kind)
    except Exception as e:  # a bench survives a fault that could not be made
        return ctx.skipped(fault.kind, f"could not inject: {type(e).__name__}: {e}")
