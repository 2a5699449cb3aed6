"""Workers that join and leave a running router (`pdserve worker --register`).

- Join, `POST /internal/workers` `{"name", "url", "role", "kv_endpoint"}`: the request's
  signature proves the caller holds the cluster secret; the router then reads the worker's own
  signed `/health` at `url`, whose proof shows that the process there holds it too, and accepts
  the worker only if that health agrees with the cluster (`compat.py`: model, dtype, context,
  KV layout, the reference fixed by the first accepted worker, registered or static) and with
  the role and KV endpoint it registered with. The same name from the same URL again (a
  restarted worker, or one whose router restarted) rejoins in place.
- Heartbeat, `PUT /internal/workers/NAME` `{"state": "serving" | "draining"}`: the worker is
  alive (`WorkerPool.grace_s` counts from the last heartbeat or proved health check); draining
  takes it out of routing before it leaves.
- Leave, `DELETE /internal/workers/NAME`.

Refusals (`ApiError`, nothing changed by any): 400 a malformed body; 409 `duplicate_worker`
(the name or the URL is already in the pool as another member); 422 `incompatible_worker`
(with the field and both values, or the proof that failed); 502 `worker_unreachable` (no
proved health from `url`); 404 `unknown_worker`; 403 `static_worker` (members given on the
router's command line are never removed and send no heartbeats).

Lifetime: one per router; its calls run on the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.api.errors import ApiError
from pdserve.common.worker_name import check_base_url, check_worker_name
from pdserve.router.compat import incompatibility
from pdserve.router.pool_metrics import PoolMetrics
from pdserve.router.worker_pool import DRAINING, ROLES, Answer, WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")

SERVING = "serving"
HEARTBEAT_STATES = (SERVING, DRAINING)


@dataclass(frozen=True)
class JoinRequest:
    name: str
    url: str
    role: str
    kv_endpoint: str | None  # host:port of its KV transfer endpoint (None: collocated)

    @classmethod
    def from_json(cls, body: object) -> JoinRequest:
        """The request in a join's JSON body; ApiError 400 saying what is wrong."""
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object with name, url, role and kv_endpoint")
        role, kv = body.get("role"), body.get("kv_endpoint")
        try:
            name = check_worker_name(body.get("name"))
            url = check_base_url(body.get("url"), "a worker's url")
        except ValueError as e:
            raise _bad(str(e)) from None
        if role not in ROLES:
            raise _bad(f"role must be one of {', '.join(ROLES)}, got {role!r}", "role")
        if kv is not None and not isinstance(kv, str):
            raise _bad("kv_endpoint must be 'host:port' or null", "kv_endpoint")
        return cls(name, url, role, kv)


class WorkerRegistry:
    """`session()` is the router's HTTP client session (made when the router starts)."""

    def __init__(self, pool: WorkerPool, session: Callable[[], aiohttp.ClientSession],
                 metrics: PoolMetrics | None = None) -> None:
        self.pool, self.session, self.metrics = pool, session, metrics
        self._last_refusal: str | None = None  # logged when it changes (workers retry)

    async def join(self, req: JoinRequest) -> tuple[WorkerHandle, bool]:
        """The member `req` names, accepted, and whether it is new (False: it rejoined)."""
        try:
            self._member(req)
            candidate = WorkerHandle(req.url, req.role, key=req.name, registered=True)
            answer = await self.pool.ask(self.session(), candidate)
            info = self._proved(req, answer)
            existing = self._member(req)  # again: another join may have won while we asked
            reason = incompatibility(info, self.pool.reference, self.pool.served_name)
            if reason is not None:
                raise ApiError(422, f"worker {req.name} refused: {reason}",
                               code="incompatible_worker")
        except ApiError as e:
            self._count(e.code or str(e.status))
            if e.message != self._last_refusal:
                log.warning("join refused (%d): %s", e.status, e.message)
                self._last_refusal = e.message
            raise
        worker = existing or candidate
        worker.role, worker.phase = req.role, None
        if existing is None:
            self.pool.add(candidate)
        self.pool.heard(worker)
        self.pool.judge(worker, answer)  # accepted: fixes the reference if it is the first
        self.pool.on_refresh()  # waiting requests may go to it now
        self._count("accepted" if existing is None else "rejoined")
        log.info("worker %s %s the pool (%s)", req.name,
                 "joined" if existing is None else "rejoined", worker.name)
        return worker, existing is None

    def beat(self, name: str, state: object = SERVING) -> WorkerHandle:
        """A heartbeat of registered member `name`; `state` draining takes it out of routing
        (serving, or None, brings it back unless it is flipping)."""
        state = SERVING if state is None else state
        if state not in HEARTBEAT_STATES:
            raise _bad(f"state must be one of {', '.join(HEARTBEAT_STATES)}, got {state!r}",
                       "state")
        worker = self.registered(name)
        self.pool.heard(worker)
        if state == DRAINING:
            worker.phase = DRAINING
        elif worker.phase == DRAINING:
            worker.phase = None
        return worker

    def leave(self, name: str) -> WorkerHandle:
        worker = self.registered(name)
        self.pool.remove(worker, "deregistered")
        return worker

    def registered(self, name: str) -> WorkerHandle:
        """The member `name`; 404 if there is none, 403 if it was given on the command line."""
        worker = self.pool.find(name)
        if worker is None:
            raise ApiError(404, f"no worker named {name!r} in the pool", code="unknown_worker")
        if not worker.registered:
            raise ApiError(403, f"worker {name} was given on the router's command line: it is "
                                "never removed and sends no heartbeats", code="static_worker")
        return worker

    def _member(self, req: JoinRequest) -> WorkerHandle | None:
        """The member this join would replace (same name, same URL, registered), or None; 409
        when the name or the URL belongs to another member."""
        existing = self.pool.find(req.name)
        if existing is not None and (not existing.registered or existing.url != req.url):
            raise ApiError(409, f"a worker named {req.name} is already in the pool, at "
                                f"{existing.url}: give this one another --name",
                           code="duplicate_worker")
        other = next((w for w in self.pool.workers if w.url == req.url and w.key != req.name),
                     None)
        if other is not None:
            raise ApiError(409, f"{req.url} is already in the pool as worker {other.key}",
                           code="duplicate_worker")
        return existing

    def _proved(self, req: JoinRequest, answer: Answer) -> dict[str, Any]:
        """The worker's proved health details, or why it may not join."""
        if answer.refused is not None:
            raise ApiError(422, f"worker {req.name} refused: the server at {req.url} "
                                f"{answer.refused}", code="incompatible_worker")
        if answer.info is None:
            why = "timed out" if answer.timed_out else "gave no proved answer"
            raise ApiError(502, f"worker {req.name} refused: the router's signed health check "
                                f"of {req.url} {why}", code="worker_unreachable")
        info = answer.info
        if info.get("role") != req.role:
            raise ApiError(422, f"worker {req.name} refused: it registered as {req.role} but "
                                f"its /health says {info.get('role')!r}",
                           code="incompatible_worker")
        peer = info.get("peer") if isinstance(info.get("peer"), dict) else {}
        reported = f"{peer['host']}:{peer['port']}" if peer.get("host") else None
        if req.kv_endpoint != reported:
            raise ApiError(422, f"worker {req.name} refused: it registered KV endpoint "
                                f"{req.kv_endpoint!r} but its /health reports {reported!r}",
                           code="incompatible_worker")
        return info

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.registrations.inc(result=result)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_worker")
