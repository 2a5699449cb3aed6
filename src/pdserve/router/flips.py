"""Role flips steered by the router: `POST /internal/workers/NAME/flip {"role": NEW}`.

A flip: the worker is put in the FLIPPING phase (the admission choosers skip it: it gets no
new work of any role), the router calls the worker's signed `POST /internal/role {"role": NEW}`
(the worker answers 200 `{"from", "to", "seconds"}` once it has drained its legs and switched;
409 if it already has that role; 400 for a bad role; 503 if draining timed out, its role
unchanged), then reads the worker's signed `/health` (its new transfer endpoint, and the role
it reports, which the router adopts whatever the answer was), and the phase ends.

Refused before anything changes (`ApiError`): 404 unknown worker; 409 `same_role`; 409
`flip_in_progress` (the worker is flipping or draining); 409 `lent` and `borrowing` (its
cores are lent, or it computes on lent cores: `core_lending.py`); 409 `last_of_role`: the flip would
leave no routable worker to serve requests that are queued or in flight: the last
decode-capable (decode or collocated) worker while any request is (every request holds a decode
slot), or the last prefill worker while split requests hold or wait for a prefill slot.
A flip the worker refused or never answered ends with the worker's status (409, 503; 502 for
one it could not be asked, 504 when it did not answer within the flip timeout).

Lifetime: one per router; the check and the phase change happen with no await between them,
so two concurrent flips cannot both take the last worker of a role.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pdserve.api.errors import ApiError, message_of
from pdserve.internal_auth import InternalAuth
from pdserve.router.pool_metrics import PoolMetrics
from pdserve.router.worker_call import NoAnswer, post_to_worker
from pdserve.router.worker_pool import FLIPPING, LENT, ROLES, WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")

ROLE_PATH = "/internal/role"
DECODE_CAPABLE = ("decode", "collocated")
Demand = Callable[[str], int]  # pool ("decode" or "prefill") -> requests queued or holding slots


def flip_refusal(worker: WorkerHandle, pool: WorkerPool, demand: Demand) -> str | None:
    """Why taking `worker` out of its role would strand requests, or None when it may flip
    (whatever the new role: while it flips it serves none)."""
    others = [w for w in pool.workers if w is not worker and w.routable]
    last_serving = worker.role in DECODE_CAPABLE and \
        not any(w.role in DECODE_CAPABLE for w in others)
    if last_serving and (n := demand("decode")):
        return (f"worker {worker.key} is the last decode-capable (decode or collocated) worker "
                f"and {n} requests are queued or in flight: the flip would leave none to serve "
                "them")
    last_prefill = worker.role == "prefill" and not any(w.role == "prefill" for w in others)
    if last_prefill and (n := demand("prefill")):
        return (f"worker {worker.key} is the last prefill worker and {n} split requests are "
                "queued or in flight for a prefill worker")
    return None


class RoleFlips:
    """`session()` is the router's HTTP client session; `timeout_s` bounds the worker's drain
    and switch as the router waits for it."""

    def __init__(self, pool: WorkerPool, auth: InternalAuth,
                 session: Callable[[], aiohttp.ClientSession], demand: Demand,
                 timeout_s: float, metrics: PoolMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.auth, self.session, self.demand = pool, auth, session, demand
        self.timeout_s, self.metrics, self.clock = timeout_s, metrics, clock
        # whether a worker computes on cores lent to it (`core_lending.py`): it keeps its role
        self.borrows: Callable[[WorkerHandle], bool] = lambda worker: False

    async def flip(self, worker: WorkerHandle, new: object) -> dict[str, Any]:
        """`{"worker", "from", "to", "seconds"}` once `worker` serves as `new`; ApiError if it
        was refused or failed (its role then is what the worker reports)."""
        self._check(worker, new)
        old, t0 = worker.role, self.clock()
        worker.phase = FLIPPING
        log.info("worker %s: flipping %s -> %s", worker.key, old, new)
        try:
            status, message = await self._ask_worker(worker, str(new))
            if status == 200:
                worker.role = str(new)
            await self._settle(worker)
        finally:
            if worker.phase == FLIPPING:
                worker.phase = None
            self.pool.on_refresh()  # waiting requests may go to it (or others) now
        if status != 200:
            raise _failed(worker, status, message, old)
        seconds = round(self.clock() - t0, 3)
        log.info("worker %s flipped %s -> %s in %.1f s", worker.key, old, new, seconds)
        if self.metrics is not None:
            self.metrics.flipped(old, str(new))
        return {"worker": worker.key, "from": old, "to": new, "seconds": seconds}

    def _check(self, worker: WorkerHandle, new: object) -> None:
        if new not in ROLES:
            raise ApiError(400, f"role must be one of {', '.join(ROLES)}, got {new!r}",
                           param="role", code="invalid_role")
        if worker.phase == LENT:
            raise ApiError(409, f"worker {worker.key} has lent its cores: reclaim them first",
                           code="lent")
        if worker.phase is not None:
            raise ApiError(409, f"worker {worker.key} is {worker.phase}: wait until it is done",
                           code="flip_in_progress")
        if self.borrows(worker):
            raise ApiError(409, f"worker {worker.key} computes on cores lent to it: reclaim "
                                "them first", code="borrowing")
        if new == worker.role:
            raise ApiError(409, f"worker {worker.key} already has role {new}", code="same_role")
        reason = flip_refusal(worker, self.pool, self.demand)
        if reason is not None:
            raise ApiError(409, reason, code="last_of_role")

    async def _ask_worker(self, worker: WorkerHandle, new: str) -> tuple[int | None, str]:
        """The worker's status and message (None: no proved answer, and why)."""
        body = {"role": new, "reason": "asked through the router"}
        try:
            status, raw = await post_to_worker(self.session(), self.auth, worker.url, ROLE_PATH,
                                               body, self.timeout_s)
        except NoAnswer as e:
            return None, str(e)
        return status, message_of(raw)

    async def _settle(self, worker: WorkerHandle) -> None:
        """One signed health check: the worker's transfer endpoint after the flip, and the role
        it reports, which is the truth whatever its answer to the flip was."""
        answer = await self.pool.ask(self.session(), worker)
        self.pool.judge(worker, answer)
        reported = (answer.info or {}).get("role")
        if reported in ROLES and reported != worker.role:
            log.warning("worker %s reports role %s (the router had %s)", worker.key, reported,
                        worker.role)
            worker.role = reported


def _failed(worker: WorkerHandle, status: int | None, message: str, old: str) -> ApiError:
    now = f"(it now has role {worker.role})" if worker.role != old else \
        f"(its role is still {old})"
    if status is None:
        code = 504 if message.startswith("did not answer") else 502
        return ApiError(code, f"worker {worker.key} {message} {now}", code="flip_failed")
    passed = status if status in (409, 503) else 502
    return ApiError(passed, f"worker {worker.key} refused the flip ({status}): {message} {now}",
                    code="flip_failed")
