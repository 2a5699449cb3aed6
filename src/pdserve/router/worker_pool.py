"""The router's view of its workers: who is in the pool, their health and load from `/health`.

Members: the static URLs of the command line (`--prefill`, `--decode`, `--collocated`), which
are never removed (only marked unhealthy), and workers that registered themselves
(`registry.py`), which leave when they deregister or when neither a proved health check nor a
heartbeat was heard from them for `grace_s`. Each member has a `key`: its `--name` when it
registered, else its URL's host:port. A member in a `phase` (flipping its role, draining before
it leaves, its cores lent to another worker: `core_lending.py`) is given no new work of any
role; `healthy(role)` lists only routable members.

Every check is a signed request (`internal_auth.py`), and the worker's answer must carry its
proof of the cluster secret: a worker that refuses the signature (401) or cannot prove the
secret is refused, "does not share the cluster secret", and never routed to (an orphan of an
earlier run or another cluster's worker on the same port).

A worker is accepted once its signed `/health` answered 200 and its details agree with the
cluster (`compat.py`): its served model name is the router's, and its dtype, context length
and KV layout equal the **reference**: the details of the first worker accepted, fixed for
the router's lifetime. Workers answering in the same round are judged in command-line order
(`--prefill`, then `--decode`, then `--collocated` URLs), so with all workers up at start the
first URL fixes it. A worker that differs is refused with the field and both values (logged
when the reason changes, not each second), stays refused while it differs, and is accepted
once it answers with matching details (restarted with the right settings).

An accepted worker is routable (`healthy`) with its transfer endpoint (a `PeerId`, whose
instance id changes when the worker restarts: new legs then name the new instance, and a
transfer set up with the old one is never trusted). A failed leg marks its worker unhealthy at
once; the next successful health check brings it back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth
from pdserve.router.compat import incompatibility
from pdserve.router.prefix_index import PrefixIndex
from pdserve.transfer.peer import PeerId

log = logging.getLogger("pdserve.router")

ROLES = ("prefill", "decode", "collocated")
# A refused connection or an error status marks a worker unhealthy at once; timeouts only after
# this many in a row (a worker in a long step on a loaded core answers late, but it answers).
SLOW_CHECKS_TO_FAIL = 3
NOT_SHARED = "does not share the cluster secret"
FLIPPING, DRAINING, LENT = "flipping", "draining", "lent"  # phases: no new work while in one


@dataclass(eq=False)
class WorkerHandle:
    url: str
    role: str
    healthy: bool = False  # accepted and answering: routable
    refused: str | None = None  # why the worker may not join (until it answers compatibly)
    peer: PeerId | None = None
    info: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0  # legs this router has open on the worker
    slow_checks: int = 0  # consecutive /health checks that timed out
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    instance: tuple[int | None, int | None] | None = None  # (peer instance id, pid) last seen
    key: str = ""  # its name in the pool: --name when it registered, else host:port of `url`
    registered: bool = False  # joined by itself: removed when it leaves or goes unheard
    phase: str | None = None  # FLIPPING, DRAINING or LENT: given no new work of any role
    last_heard: float = 0.0  # monotonic time of its last proved /health or heartbeat

    def __post_init__(self) -> None:
        if not self.key:
            self.key = urlsplit(self.url).netloc or self.url

    @property
    def routable(self) -> bool:
        return self.healthy and self.phase is None

    @property
    def state(self) -> str:
        """healthy, unhealthy, or its phase (flipping, draining, lent)."""
        return self.phase or ("healthy" if self.healthy else "unhealthy")

    @property
    def load(self) -> float:
        """Legs in flight from here, then (as a tie-break below one leg) KV pool usage."""
        used, total = self.info.get("kv_blocks_used", 0), self.info.get("kv_blocks_total", 1)
        return self.inflight + 0.5 * used / max(total, 1)

    @property
    def name(self) -> str:
        return f"{self.role} {self.url}"


@dataclass(frozen=True)
class Answer:
    """One health check's outcome: signed details whose proof matched, or why the worker
    cannot be trusted, or neither (down, loading, an error status)."""

    info: dict[str, Any] | None = None
    refused: str | None = None
    timed_out: bool = False


class WorkerPool:
    """`urls`: the static members per role (none at all: every worker registers). `grace_s`:
    how long a registered member may go unheard before it is removed."""

    def __init__(self, urls: dict[str, list[str]], auth: InternalAuth, served_name: str,
                 health_interval_s: float = 1.0, health_timeout_s: float = 2.0,
                 grace_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        bad = set(urls) - set(ROLES)
        if bad:
            raise ValueError(f"unknown worker roles {sorted(bad)}; use {ROLES}")
        self.workers: list[WorkerHandle] = []
        for role in ROLES:
            for url in urls.get(role, []):
                self.workers.append(WorkerHandle(url.rstrip("/"), role,
                                                 key=self._free_key(url.rstrip("/"))))
        self.auth, self.served_name = auth, served_name
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.grace_s, self.clock = grace_s, clock
        self.reference: dict[str, Any] | None = None  # the first accepted worker's details
        self._task: asyncio.Task | None = None
        # called after every round: a worker that came back may take queued requests
        self.on_refresh: Callable[[], None] = lambda: None
        # called with each worker marked failed by a leg's failure (its circuit breaker counts)
        self.on_failed: Callable[[WorkerHandle], None] = lambda worker: None
        # called with each member removed and the reason ("deregistered", "unheard")
        self.on_removed: list[Callable[[WorkerHandle, str], None]] = []
        # called with each worker whose proved /health was just read into its `info`
        self.on_health: list[Callable[[WorkerHandle], None]] = []

    def healthy(self, role: str) -> list[WorkerHandle]:
        """The routable members of `role`: accepted, answering, and in no phase."""
        return [w for w in self.workers if w.role == role and w.routable]

    def find(self, key: str) -> WorkerHandle | None:
        return next((w for w in self.workers if w.key == key), None)

    def add(self, worker: WorkerHandle) -> None:
        """A registered member joins (its key is unique: `registry.py` checks)."""
        worker.last_heard = self.clock()
        self.workers.append(worker)

    def remove(self, worker: WorkerHandle, reason: str, detail: str = "") -> None:
        """A registered member leaves (`reason`: "deregistered" or "unheard"); legs already on
        it run on (their admission slots hold the handle until they end)."""
        if worker in self.workers:
            self.workers.remove(worker)
            log.info("worker %s (%s) removed: %s%s", worker.key, worker.name, reason,
                     f" ({detail})" if detail else "")
            for removed in self.on_removed:
                removed(worker, reason)

    def heard(self, worker: WorkerHandle) -> None:
        worker.last_heard = self.clock()

    def expire(self) -> None:
        """Removes the registered members unheard for longer than the grace period."""
        now = self.clock()
        for w in [w for w in self.workers if w.registered and now - w.last_heard > self.grace_s]:
            self.remove(w, "unheard", f"for {now - w.last_heard:.1f} s, grace {self.grace_s:g} s")

    def _free_key(self, url: str) -> str:
        key = urlsplit(url).netloc or url
        taken = {w.key for w in self.workers}
        return next(k for k in (key, *(f"{key}-{i}" for i in range(2, len(taken) + 3)))
                    if k not in taken)

    @property
    def model_info(self) -> dict[str, Any] | None:
        """The cluster's reference details (model name, context length, KV layout) once a
        worker was accepted; every accepted worker shares them."""
        return self.reference

    @property
    def block_size(self) -> int | None:
        return self.reference["kv_layout"]["block_size"] if self.reference else None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._watch(session))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """One round: every worker asked at once, the answers judged in command-line order
        (then registration order); registered members unheard too long are removed."""
        workers = list(self.workers)
        answers = await asyncio.gather(*(self.ask(session, w) for w in workers))
        for worker, answer in zip(workers, answers, strict=True):
            if answer.info is not None:
                self.heard(worker)
            self.judge(worker, answer)
        self.expire()
        self.on_refresh()

    def mark_failed(self, worker: WorkerHandle, why: str) -> None:
        if worker.healthy:
            log.warning("worker %s marked unhealthy: %s", worker.name, why)
        worker.healthy = False
        self.on_failed(worker)

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.refresh(session)
            await asyncio.sleep(self.health_interval_s)

    async def ask(self, session: aiohttp.ClientSession, w: WorkerHandle) -> Answer:
        """One signed health check of `w` (judged by `judge`)."""
        headers = self.auth.headers("GET", "/health")
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
            async with session.get(f"{w.url}/health", headers=headers, timeout=timeout) as resp:
                status, proof, body = resp.status, resp.headers.get(PROOF_HEADER), \
                    await resp.read()
        except TimeoutError:
            return Answer(timed_out=True)
        except aiohttp.ClientError:
            return Answer()
        if status in (401, 403):  # a bad signature, or a worker without a secret
            return Answer(refused=f"{NOT_SHARED} (it answered {status} to the router's signed "
                                  "request)")
        if status != 200:
            return Answer()
        if not self.auth.check_proof(headers[AUTH_HEADER], body, proof):
            return Answer(refused=f"{NOT_SHARED} (its answer carries no valid proof of it)")
        try:
            info = json.loads(body)
        except ValueError:
            return Answer()
        return Answer(info=info) if isinstance(info, dict) else Answer()

    def judge(self, w: WorkerHandle, answer: Answer) -> None:
        """Applies one check's answer to the worker's state (and may fix the reference)."""
        if answer.timed_out:
            w.slow_checks += 1  # busy (a long prefill step on a loaded core), maybe not dead
            if w.slow_checks >= SLOW_CHECKS_TO_FAIL and w.healthy:
                log.warning("worker %s did not answer /health %d times in a row", w.name,
                            w.slow_checks)
                w.healthy = False
            return
        w.slow_checks = 0
        if answer.refused is not None:
            self._refuse(w, answer.refused)
        elif answer.info is None:
            if w.healthy:
                log.warning("worker %s stopped answering /health", w.name)
            w.healthy = False
        else:
            self._meet(w, answer.info)

    def _meet(self, w: WorkerHandle, info: dict[str, Any]) -> None:
        try:
            peer = PeerId.from_json(info["peer"]) if info.get("peer") else None
        except (ValueError, TypeError) as e:
            self._refuse(w, f"its /health names no valid transfer endpoint: {e}")
            return
        self._note_instance(w, peer, info.get("pid"))
        w.info, w.peer = info, peer
        for heard in self.on_health:
            heard(w)
        self._follow_role(w, info.get("role"))
        reason = incompatibility(info, self.reference, self.served_name)
        if reason is not None:
            self._refuse(w, reason)
            return
        if self.reference is None:
            self.reference = info
            log.info("cluster reference set by worker %s: dtype %s, max_model_len %s, KV "
                     "layout %s", w.name, info["dtype"], info["max_model_len"],
                     info["kv_layout"])
        if w.refused is not None:
            log.info("worker %s accepted (it was refused: %s)", w.name, w.refused)
        elif not w.healthy:
            log.info("worker %s is healthy", w.name)
        w.refused, w.healthy = None, True

    def _refuse(self, w: WorkerHandle, reason: str) -> None:
        if w.refused != reason:
            log.warning("worker %s refused, not routed to: %s", w.name, reason)
        w.refused, w.healthy = reason, False

    @staticmethod
    def _follow_role(w: WorkerHandle, reported: object) -> None:
        """A registered member's role is the one it reports (it may have been flipped by a
        call to the worker itself); a static member's is its command line's. Not while the
        router flips it (the flip settles the role)."""
        if w.registered and w.phase is None and reported in ROLES and reported != w.role:
            log.warning("worker %s reports role %s (the router had %s): following it", w.key,
                        reported, w.role)
            w.role = str(reported)

    @staticmethod
    def _note_instance(w: WorkerHandle, peer: PeerId | None, pid: object) -> None:
        instance = (peer.instance_id if peer else None, pid if isinstance(pid, int) else None)
        if w.instance is not None and instance != w.instance:
            log.warning("worker %s restarted (new instance %s, pid %s)", w.name,
                        f"{instance[0]:016x}" if instance[0] is not None else "-", instance[1])
        w.instance = instance
