"""The router's view of its workers: static URLs per role, health and load from `/health`.

A worker is routable once its `/health` answered 200 with its transfer endpoint (a `PeerId`,
whose instance id changes when the worker restarts: new legs then name the new instance, and a
transfer set up with the old one is never trusted). A failed leg marks its worker unhealthy at
once; the next successful health check brings it back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.router.prefix_index import PrefixIndex
from pdserve.transfer.descriptors import PeerId

log = logging.getLogger("pdserve.router")

ROLES = ("prefill", "decode", "collocated")
# A refused connection or an error status marks a worker unhealthy at once; timeouts only after
# this many in a row (a worker in a long step on a loaded core answers late, but it answers).
SLOW_CHECKS_TO_FAIL = 3


@dataclass(eq=False)
class WorkerHandle:
    url: str
    role: str
    healthy: bool = False
    peer: PeerId | None = None
    info: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0  # legs this router has open on the worker
    slow_checks: int = 0  # consecutive /health checks that timed out
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> float:
        """Legs in flight from here, then (as a tie-break below one leg) KV pool usage."""
        used, total = self.info.get("kv_blocks_used", 0), self.info.get("kv_blocks_total", 1)
        return self.inflight + 0.5 * used / max(total, 1)

    @property
    def name(self) -> str:
        return f"{self.role} {self.url}"


class WorkerPool:
    def __init__(self, urls: dict[str, list[str]], health_interval_s: float = 1.0,
                 health_timeout_s: float = 2.0) -> None:
        bad = set(urls) - set(ROLES)
        if bad:
            raise ValueError(f"unknown worker roles {sorted(bad)}; use {ROLES}")
        self.workers = [WorkerHandle(u.rstrip("/"), role) for role in ROLES
                        for u in urls.get(role, [])]
        if not self.workers:
            raise ValueError("the router needs at least one worker URL")
        if urls.get("prefill") and not urls.get("decode"):
            raise ValueError("prefill workers need at least one decode worker to hand over to")
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self._task: asyncio.Task | None = None

    def healthy(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role == role and w.healthy]

    @property
    def model_info(self) -> dict[str, Any] | None:
        """`/health` info of any healthy worker (model name and context length)."""
        return next((w.info for w in self.workers if w.healthy), None)

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._watch(session))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._check(session, w) for w in self.workers))

    def mark_failed(self, worker: WorkerHandle, why: str) -> None:
        if worker.healthy:
            log.warning("worker %s marked unhealthy: %s", worker.name, why)
        worker.healthy = False

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.refresh(session)
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, session: aiohttp.ClientSession, w: WorkerHandle) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
            async with session.get(f"{w.url}/health", timeout=timeout) as resp:
                info = await resp.json() if resp.status == 200 else None
        except TimeoutError:
            w.slow_checks += 1  # busy (a long prefill step on a loaded core), maybe not dead
            if w.slow_checks >= SLOW_CHECKS_TO_FAIL and w.healthy:
                log.warning("worker %s did not answer /health %d times in a row", w.name,
                            w.slow_checks)
                w.healthy = False
            return
        except (aiohttp.ClientError, ValueError):
            info = None
        w.slow_checks = 0
        if info is None:
            if w.healthy:
                log.warning("worker %s stopped answering /health", w.name)
            w.healthy = False
            return
        peer = PeerId.from_json(info["peer"]) if info.get("peer") else None
        if w.peer is not None and peer is not None and peer != w.peer:
            log.warning("worker %s restarted (new instance %016x)", w.name, peer.instance_id)
        if not w.healthy:
            log.info("worker %s is healthy", w.name)
        w.info, w.peer, w.healthy = info, peer, True
