"""The router's signed endpoints for workers and operators, all under `/internal/workers`.

- `GET /internal/workers`: 200, a list of every member: name, url, role, state, registered,
  queue, legs, kv_blocks_used, kv_blocks_total, kv_endpoint, refused, cpus (the cores it
  reports), lent_to (the borrower of its cores, or null).
- `POST /internal/workers` (a worker joins, `registry.py`): 201 when new, 200 when it
  rejoined, `{"name", "role", "state"}`.
- `PUT /internal/workers/NAME` (its heartbeat): 200 `{"name", "state"}`.
- `DELETE /internal/workers/NAME` (it leaves): 200 `{"name", "removed": true}`.
- `POST /internal/workers/NAME/flip` `{"role"}` (`flips.py`): 200 `{"worker", "from", "to",
  "seconds"}`.
- `POST /internal/workers/NAME/lend` `{"to": B}` (`core_lending.py`): 200 `{"worker", "to",
  "cpus", "seconds"}`; `POST /internal/workers/NAME/reclaim`: 200 `{"worker", "from", "cpus",
  "pinned_back", "seconds"}`.

Every request must be signed with the cluster secret for its method and path
(`internal_auth.py`; 401 `invalid_internal_auth` without or with a bad, stale or replayed
signature), checked before the body is read; every answer to a signed request carries the
router's proof that it holds the secret too (`X-Pdserve-Proof`). Errors are OpenAI-shaped JSON
(`ApiError`), unknown paths and methods under `/internal/` included. A worker's `queue` is the
requests holding an admission slot on it (`admission.py`: in flight there); `legs` the legs
this router has open on it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdserve.api.errors import ApiError
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth, PeerRefused
from pdserve.router.core_lending import CoreLending
from pdserve.router.flips import RoleFlips
from pdserve.router.registry import JoinRequest, WorkerRegistry
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

INTERNAL_PREFIX = "/internal/"
WORKERS_PATH = "/internal/workers"
MAX_BODY_BYTES = 64 * 1024  # a join, a flip or a loan is a few hundred bytes
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminApi:
    """`queued(worker)`: requests holding an admission slot on `worker`."""

    def __init__(self, auth: InternalAuth, pool: WorkerPool, registry: WorkerRegistry,
                 flips: RoleFlips, lending: CoreLending,
                 queued: Callable[[WorkerHandle], int]) -> None:
        self.auth, self.pool, self.registry, self.flips = auth, pool, registry, flips
        self.lending, self.queued = lending, queued
        self._changes: set[asyncio.Future] = set()  # flips and loans under way

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(WORKERS_PATH, self.list_workers)
        app.router.add_post(WORKERS_PATH, self.join)
        app.router.add_put(WORKERS_PATH + "/{name}", self.beat)
        app.router.add_delete(WORKERS_PATH + "/{name}", self.leave)
        app.router.add_post(WORKERS_PATH + "/{name}/flip", self.flip)
        app.router.add_post(WORKERS_PATH + "/{name}/lend", self.lend)
        app.router.add_post(WORKERS_PATH + "/{name}/reclaim", self.reclaim)
        app.middlewares.append(self.middleware())

    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        @web.middleware
        async def signed(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.path.startswith(INTERNAL_PREFIX):
                return await handler(request)
            header = request.headers.get(AUTH_HEADER)
            try:
                self.auth.verify(request.method, request.path, header)
            except PeerRefused as e:
                return _error(ApiError(401, str(e), code="invalid_internal_auth"))
            try:
                response = await handler(request)
            except ApiError as e:
                response = _error(e)
            except web.HTTPException as e:  # no such path or method here
                response = _error(ApiError(e.status, f"{request.method} {request.path}: "
                                                     f"{e.reason}"))
            if isinstance(response, web.Response) and isinstance(response.body, bytes):
                response.headers[PROOF_HEADER] = self.auth.proof(header, response.body)
            return response

        return signed

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response([self.describe(w) for w in self.pool.workers])

    def describe(self, w: WorkerHandle) -> dict[str, Any]:
        return {"name": w.key, "url": w.url, "role": w.role, "state": w.state,
                "registered": w.registered, "queue": self.queued(w), "legs": w.inflight,
                "kv_blocks_used": w.info.get("kv_blocks_used"),
                "kv_blocks_total": w.info.get("kv_blocks_total"),
                "kv_endpoint": _endpoint(w), "refused": w.refused,
                "cpus": w.info.get("cpus"), "lent_to": self.lending.lent_to(w)}

    async def join(self, request: web.Request) -> web.Response:
        worker, new = await self.registry.join(JoinRequest.from_json(await _body(request)))
        return web.json_response({"name": worker.key, "role": worker.role,
                                  "state": worker.state}, status=201 if new else 200)

    async def beat(self, request: web.Request) -> web.Response:
        body = await _body(request, required=False)
        state = body.get("state") if isinstance(body, dict) else body
        worker = self.registry.beat(request.match_info["name"], state)
        return web.json_response({"name": worker.key, "state": worker.state})

    async def leave(self, request: web.Request) -> web.Response:
        worker = self.registry.leave(request.match_info["name"])
        return web.json_response({"name": worker.key, "removed": True})

    async def flip(self, request: web.Request) -> web.Response:
        body = await _body(request)
        worker = self._worker(request.match_info["name"])
        role = body.get("role") if isinstance(body, dict) else None
        return await self._finish(self.flips.flip(worker, role))

    async def lend(self, request: web.Request) -> web.Response:
        body = await _body(request)
        lender = self._worker(request.match_info["name"])
        to = body.get("to") if isinstance(body, dict) else None
        if not isinstance(to, str):
            raise ApiError(400, 'the body must be a JSON object like {"to": "WORKER"}',
                           param="to")
        return await self._finish(self.lending.lend(lender, self._worker(to)))

    async def reclaim(self, request: web.Request) -> web.Response:
        await _body(request, required=False)
        return await self._finish(self.lending.reclaim(self._worker(request.match_info["name"])))

    def _worker(self, name: str) -> WorkerHandle:
        worker = self.pool.find(name)
        if worker is None:
            raise ApiError(404, f"no worker named {name!r} in the pool", code="unknown_worker")
        return worker

    async def _finish(self, change: Awaitable[dict[str, Any]]) -> web.Response:
        """`change` (a flip or a loan) run to its end even if the caller leaves (the worker
        changes anyway, and the router must settle what it does), its result answered."""
        future = asyncio.ensure_future(change)
        self._changes.add(future)
        future.add_done_callback(self._done)
        return web.json_response(await asyncio.shield(future))

    def _done(self, future: asyncio.Future) -> None:
        self._changes.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a refusal nobody waited for is not an error


async def _body(request: web.Request, required: bool = True) -> Any:
    """The request's JSON body (None when empty and not `required`); 400/413 otherwise."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    raw = await request.read()  # bounded by the app's client_max_size without a length
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    if not raw.strip() and not required:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError(400, "the body must be JSON") from None


def _endpoint(w: WorkerHandle) -> str | None:
    return f"{w.peer.host}:{w.peer.port}" if w.peer is not None else None


def _error(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers)
