"""The flips of `pdserve bench flip`: one decode worker flipped decode -> prefill -> decode ...
through the router's signed `POST /internal/workers/NAME/flip` (`pdserve ctl flip`'s call, made
with its `RouterClient`), one at a time, each awaited.

Per flip: `seconds` is the router's reply (from its flip command to the worker serving in its
new role and routable again); `call_s` the bench's own time from sending the command to the
reply; `first_step_s` from sending the command (wall clock) to the end of the first engine step
the worker ran in its new role, read from its signed `/internal/steps` at the end of the pause
after the reply: the steps that started at or after its `role_since` (when its current role
began, same machine, same clock). None when it ran no step in its new role within the pause,
or its trace was unreadable or shows another role.

A flip the router refuses with 409 (it would leave no worker of a role for queued or running
requests, or the worker is busy flipping) is `refused`; any other error is `failed`; after
either, the worker's role is read back from the router, and the next flip goes from it.
Blocking calls run on threads, so the clients' event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.chaos.workers import Workers
from pdserve.ctl.cli import WORKERS_PATH
from pdserve.ctl.client import CtlError, RouterClient

DONE, REFUSED, FAILED = "done", "refused", "failed"
MOVES = re.compile(r'^pdserve_router_migrations_total\{reason="(?P<reason>[^"]*)"\} (?P<n>\S+)$')


@dataclass(frozen=True)
class FlipTarget:
    """The flipped worker: its name in the router's pool, in `pdserve up`'s layout, its URL."""

    name: str
    label: str
    url: str


@dataclass(frozen=True)
class FlipRecord:
    n: int
    worker: str  # the layout's name, e.g. decode-0
    from_role: str
    to_role: str
    at_s: float  # the command, in seconds since the load started
    call_s: float
    status: str  # DONE, REFUSED or FAILED
    seconds: float | None = None  # the router's reply (DONE only)
    first_step_s: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def flip_target(client: RouterClient, workers: Workers) -> FlipTarget:
    """The first decode worker of the router's pool."""
    pool = client.call("GET", WORKERS_PATH)
    for entry in pool:
        if entry["role"] == "decode":
            url = entry["url"].rstrip("/")
            label = next((w.name for w in workers.all if workers.up.worker_url(w.index) == url),
                         entry["name"])
            return FlipTarget(entry["name"], label, url)
    raise RuntimeError(f"the router's pool has no decode worker to flip: {pool}")


def role_now(client: RouterClient, target: FlipTarget, fallback: str) -> str:
    """The worker's role as the router has it (`fallback` when it cannot be read)."""
    try:
        pool = client.call("GET", WORKERS_PATH)
    except CtlError:
        return fallback
    return next((w["role"] for w in pool if w["name"] == target.name), fallback)


def first_step_s(workers: Workers, target: FlipTarget, commanded: float, role: str
                 ) -> float | None:
    """From `commanded` (wall clock) to the end of the worker's first step in `role` (see the
    module docstring)."""
    try:
        trace = workers.up.internal_json(f"{target.url}/internal/steps?since={commanded!r}")
        fields = trace["fields"]
        start, end = fields.index("start"), fields.index("end")
        if trace["role"] != role:
            return None
        ends = [s[end] for s in trace["steps"] if s[start] >= trace["role_since"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return round(min(ends) - commanded, 3) if ends else None


def streams_moved(router_url: str) -> dict[str, int]:
    """The router's streams continued on another worker so far, by reason (its
    `pdserve_router_migrations_total`; a worker changing role hands its running streams back
    under one of them)."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {m["reason"]: round(float(m["n"])) for line in text.splitlines()
            if (m := MOVES.match(line)) is not None}


@dataclass(frozen=True)
class Flipping:
    """What every flip of a run needs: `t0` is the load's perf_counter start; `progress` is
    called with each record as it is made."""

    client: RouterClient
    workers: Workers
    target: FlipTarget
    pause_s: float
    t0: float
    progress: Callable[[FlipRecord, int], None]


async def flip_once(f: Flipping, n: int, old: str) -> FlipRecord:
    """Flip `n`: `old` -> the other of decode and prefill, then the pause."""
    new = "prefill" if old == "decode" else "decode"
    path = f"{WORKERS_PATH}/{f.target.name}/flip"
    commanded, sent = time.time(), time.perf_counter()
    common = {"n": n, "worker": f.target.label, "from_role": old, "to_role": new,
              "at_s": round(sent - f.t0, 3)}
    try:
        reply = await asyncio.to_thread(f.client.call, "POST", path, {"role": new})
    except CtlError as e:
        status = REFUSED if e.status == 409 else FAILED
        record = FlipRecord(**common, call_s=round(time.perf_counter() - sent, 3),
                            status=status, error=str(e))
        await asyncio.sleep(f.pause_s)
        return record
    call_s = round(time.perf_counter() - sent, 3)
    await asyncio.sleep(f.pause_s)
    first = await asyncio.to_thread(first_step_s, f.workers, f.target, commanded, new)
    return FlipRecord(**common, call_s=call_s, status=DONE, seconds=float(reply["seconds"]),
                      first_step_s=first)


async def flip_all(f: Flipping, flips: int) -> list[FlipRecord]:
    """`flips` flips, one after another, after a first pause under load; the first from
    decode."""
    records: list[FlipRecord] = []
    role = "decode"
    await asyncio.sleep(f.pause_s)
    for n in range(1, flips + 1):
        record = await flip_once(f, n, role)
        records.append(record)
        f.progress(record, flips)
        role = record.to_role if record.status == DONE else \
            await asyncio.to_thread(role_now, f.client, f.target, role)
    return records
