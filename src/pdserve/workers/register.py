"""A worker that joins a running router by itself: `pdserve worker --register http://ROUTER`.

Lifetime: the worker server calls `start_registration` once its model is loaded; the task it
starts joins (signed `POST /internal/workers` with the worker's name, URL, role and KV
endpoint: the router then reads this worker's signed /health and checks it against the
cluster), then sends a signed heartbeat (`PUT /internal/workers/NAME`) every `heartbeat_s`. A
heartbeat answered 404 (the router restarted, or removed this worker after a silence) joins
again. A refused join (401: another cluster secret; 409: the name or URL is taken; 422:
incompatible with the cluster) is logged with the router's reason, once per reason, and
retried every `retry_s`; the worker keeps running, serving nobody.

`leave()`, on SIGTERM before the HTTP server stops: a "draining" heartbeat (the router gives
the worker no new legs), a wait until its legs are done (at most `drain_timeout_s`), then
`DELETE /internal/workers/NAME`. Every call is bounded by `call_timeout_s`; a router that is
gone delays the worker's exit by at most one timeout per call.

Every answer the worker acts on must carry the router's proof of the cluster secret.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.api.errors import message_of
from pdserve.common.worker_name import check_base_url, check_worker_name
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth

log = logging.getLogger("pdserve.worker")

WORKERS_PATH = "/internal/workers"
Info = Callable[[], dict[str, Any]]  # the worker's signed /health details (role, peer, legs)


@dataclass(frozen=True)
class JoinSettings:
    router: str  # the router's base URL
    name: str  # this worker's name in the pool
    url: str  # this worker's base URL, as the router reaches it
    drain_timeout_s: float = 30.0
    heartbeat_s: float = 2.0
    retry_s: float = 5.0
    call_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "router", check_base_url(self.router, "--register"))
        check_worker_name(self.name)
        if self.drain_timeout_s < 0:
            raise ValueError("--drain-timeout must be >= 0 seconds")
        for name in ("heartbeat_s", "retry_s", "call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")


class Registration:
    def __init__(self, settings: JoinSettings, auth: InternalAuth, info: Info) -> None:
        self.settings, self.auth, self.info = settings, auth, info
        self.joined = False  # the router's last answer listed this worker
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._last_refusal: str | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._run())

    async def leave(self) -> None:
        """Drain through the router, then deregister; never raises."""
        if self._task is None:
            return  # never started
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        try:
            # Asked even when no join was confirmed here: the router may have accepted one
            # whose answer the cancelled task never read. 404: not in the pool, nothing to do.
            status, _ = await self._call("PUT", self._path, {"state": "draining"})
            if status == 200:
                await self._drain()
                status, _ = await self._call("DELETE", self._path)
                log.info("left the router at %s (%s)", self.settings.router,
                         "deregistered" if status == 200 else f"answer {status}")
        finally:
            if self._session is not None:
                await self._session.close()

    @property
    def _path(self) -> str:
        return f"{WORKERS_PATH}/{self.settings.name}"

    async def _run(self) -> None:
        while True:
            self.joined = await self._join()
            while self.joined:
                await asyncio.sleep(self.settings.heartbeat_s)
                status, _ = await self._call("PUT", self._path, {"state": "serving"})
                if status == 404:
                    log.warning("the router at %s no longer lists this worker: joining again",
                                self.settings.router)
                    self.joined = False
            await asyncio.sleep(self.settings.retry_s)

    async def _join(self) -> bool:
        info = self.info()
        peer = info.get("peer")
        card = {"name": self.settings.name, "url": self.settings.url, "role": info["role"],
                "kv_endpoint": f"{peer['host']}:{peer['port']}" if peer else None}
        status, message = await self._call("POST", WORKERS_PATH, card)
        if status in (200, 201):
            log.info("joined the router at %s as %s (%s)", self.settings.router,
                     self.settings.name, info["role"])
            self._last_refusal = None
            return True
        refusal = f"{status}: {message}" if status is not None else message
        if refusal != self._last_refusal:
            log.error("the router at %s refused this worker (%s); trying again every %g s",
                      self.settings.router, refusal, self.settings.retry_s)
            self._last_refusal = refusal
        return False

    async def _drain(self) -> None:
        """Until this worker's legs are done, at most the drain timeout."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        await asyncio.sleep(min(0.2, self.settings.drain_timeout_s))  # legs already sent
        while (legs := self.info().get("legs", 0)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if legs:
            log.warning("leaving with %d legs still open (--drain-timeout %g s)", legs,
                        self.settings.drain_timeout_s)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None
                    ) -> tuple[int | None, str]:
        """The router's status and message (None: no proved answer, and why)."""
        headers = self.auth.headers(method, path)
        timeout = aiohttp.ClientTimeout(total=self.settings.call_timeout_s)
        try:
            async with self._session.request(method, self.settings.router + path, json=body,
                                             headers=headers, timeout=timeout) as resp:
                status, raw = resp.status, await resp.read()
                proof = resp.headers.get(PROOF_HEADER)
        except (aiohttp.ClientError, TimeoutError) as e:
            return None, f"the router could not be reached: {e!r}"
        if status < 400 and not self.auth.check_proof(headers[AUTH_HEADER], raw, proof):
            return None, "the answer carries no proof of the cluster secret (not the router?)"
        return status, message_of(raw)


def start_registration(settings: JoinSettings | None, secret: bytes | None, info: Info
                       ) -> Registration | None:
    """The started registration of a worker given `--register`, else None."""
    if settings is None or secret is None:
        return None
    registration = Registration(settings, InternalAuth(secret), info)
    registration.start()
    return registration


