"""The router process: the OpenAI front door over prefill, decode and collocated workers.

Life cycle.
1. Read the cluster secret and the access settings (a bad one refuses before anything
   loads), load the tokenizer (the router renders chat templates and tokenizes; workers only
   ever see token ids), start the HTTP server and the health watcher (every worker's signed
   `/health` once a second: readiness, transfer endpoint, load, compatibility). The pool may
   start empty: workers started with `--register` join it, and leave it, while the router runs
   (`registry.py`); operators list the pool, flip roles and lend a prefill worker's cores to a
   decode worker of the same machine (`admin.py`, `flips.py`, `core_lending.py`; `pdserve
   ctl`), and with `--elastic` the router does both itself (`elastic.py`).
2. Serve. `/health` is 200 while some worker can finish a request (a decode or collocated
   worker is healthy); it says only that to anyone, and lists the workers (healthy, refused
   and why) to a request signed with the cluster secret. `/v1/*` and `/metrics` are guarded
   by `access.py` (API keys, rate limit, metrics key) before a body is read. Requests go
   through `Dispatcher`, which admits them first (`admission.py`: a cap of requests per
   worker, a bounded queue here, 429 or 503 with Retry-After beyond it); one request id
   (`cmpl-...`, `chatcmpl-...`) names the request in the router's, the prefill's and the
   decode's logs.
3. SIGTERM / SIGINT: stop accepting; in-flight handlers are cancelled, which closes their
   legs, which the workers cancel.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from pdserve.api.errors import ApiError
from pdserve.api.http_site import start_site, stop_event
from pdserve.api.limits import RequestLimits, add_limit_args, limits_from_args
from pdserve.api.openai_server import GenerateError, OpenAIServer, ResponseHeaders
from pdserve.cli_args import add_log_level_arg, log_level
from pdserve.common.model_folder import resolve_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import load_tokenizer
from pdserve.heap import freeze_startup_heap
from pdserve.internal_auth import (
    AUTH_HEADER,
    PROOF_HEADER,
    InternalAuth,
    PeerRefused,
    read_secret_file,
)
from pdserve.legs.protocol import EventBatch
from pdserve.metrics import CONTENT_TYPE
from pdserve.router.access import (
    AccessSettings,
    access_from_args,
    access_middleware,
    add_access_args,
)
from pdserve.router.admin import AdminApi
from pdserve.router.admission import Overloaded
from pdserve.router.admission_settings import (
    AdmissionSettings,
    add_admission_args,
    admission_from_args,
)
from pdserve.router.core_lending import CoreLending
from pdserve.router.dispatch import Dispatcher, DispatchSettings, NoWorkers
from pdserve.router.elastic_controller import ElasticController
from pdserve.router.elastic_settings import ElasticSettings, add_elastic_args, elastic_from_args
from pdserve.router.flips import RoleFlips
from pdserve.router.leg_client import LegFailed, RouterLegChannels
from pdserve.router.path_choice import ROUTE_HEADER, Choice
from pdserve.router.policies import PolicyName, make_policy
from pdserve.router.pool_metrics import PoolMetrics
from pdserve.router.registry import WorkerRegistry
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")
# Retry-After of a 503 when no worker can serve and none is expected back: a supervisor's
# restart or a new worker's registration takes seconds, a health round one.
NO_WORKERS_RETRY_S = 5.0


@dataclass(frozen=True)
class RouterSettings:
    model: str = "smollm2"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    collocated: tuple[str, ...] = ()
    policy: str = PolicyName.LEAST_LOADED.value
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    limits: RequestLimits = field(default_factory=RequestLimits)  # what its /v1 accepts
    worker_grace_s: float = 10.0  # a registered worker unheard this long is removed
    flip_timeout_s: float = 300.0  # the longest the router waits for a worker's role flip
    elastic: ElasticSettings | None = None  # --elastic: the router flips roles itself
    # the cluster secret shared with every worker (--secret-file)
    secret: bytes = field(kw_only=True, repr=False)

    def __post_init__(self) -> None:
        make_policy(self.policy)  # raises ValueError for an unknown name
        InternalAuth(self.secret)  # raises ValueError for a too-short secret
        if not self.worker_grace_s > 0:
            raise ValueError("--worker-grace must be > 0 seconds")
        if not self.flip_timeout_s > 0:
            raise ValueError("--flip-timeout must be > 0 seconds")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.auth = InternalAuth(settings.secret)
        self.pool = WorkerPool({"prefill": list(settings.prefill),
                                "decode": list(settings.decode),
                                "collocated": list(settings.collocated)},
                               self.auth, settings.name, grace_s=settings.worker_grace_s)
        self.metrics.bind_pool(self.pool)
        self.pool_metrics = PoolMetrics(self.metrics, self.pool)
        tokenizer = load_tokenizer(resolve_model(settings.model))
        self.api = OpenAIServer(settings.name, tokenizer, self._max_model_len, self._generate,
                                self.metrics, limits=settings.limits)
        self.session: aiohttp.ClientSession | None = None
        self.channels: RouterLegChannels | None = None
        self.dispatcher: Dispatcher | None = None
        self.admin: AdminApi | None = None
        self._dropping: set[asyncio.Task] = set()  # closing the channels of removed workers
        self.elastic: ElasticController | None = None

    def _max_model_len(self) -> int | None:
        info = self.pool.model_info
        return info["max_model_len"] if info else None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector)
        self.channels = RouterLegChannels(self.session, self.auth,
                                          self.settings.dispatch.connect_timeout_s)
        self.dispatcher = Dispatcher(self.pool, make_policy(self.settings.policy),
                                     self.settings.dispatch, self.channels, self.metrics,
                                     self.settings.admission)
        self.admin = self._admin()
        self.pool.on_removed.append(self._drop_channel)
        await self.pool.refresh(self.session)
        self.pool.start(self.session)
        if self.settings.elastic is not None:
            self.elastic = ElasticController(self.pool, self.dispatcher.queues,
                                             self.dispatcher.paths.backlog, self.admin.flips,
                                             self.admin.lending, self.settings.elastic)
            self.elastic.start()

    def _admin(self) -> AdminApi:
        session = self._session
        registry = WorkerRegistry(self.pool, session, self.pool_metrics)
        flips = RoleFlips(self.pool, self.auth, session, self._demand,
                          self.settings.flip_timeout_s, self.pool_metrics)
        prefill = self.dispatcher.queues["prefill"]
        lending = CoreLending(self.pool, self.auth, session, self._queued,
                              lambda: prefill.depth, self.settings.flip_timeout_s,
                              self.pool_metrics)
        flips.borrows = lending.borrows
        return AdminApi(self.auth, self.pool, registry, flips, lending, self._queued)

    def _drop_channel(self, worker: WorkerHandle, reason: str) -> None:
        task = asyncio.ensure_future(self.channels.drop(worker))
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the router was not started"
        return self.session

    def _queued(self, worker: WorkerHandle) -> int:
        """Requests holding an admission slot on `worker` (in flight there)."""
        return sum(q.held(worker) for q in self.dispatcher.queues.values())

    def _demand(self, pool: str) -> int:
        """Requests waiting for or holding a slot in admission pool `pool`."""
        queue = self.dispatcher.queues[pool]
        return queue.depth + sum(queue.held(w) for w in self.pool.workers)

    async def stop(self) -> None:
        if self.elastic is not None:
            await self.elastic.stop()
        await self.pool.stop()
        if self.channels is not None:
            await self.channels.close()
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.limits.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        self.api.add_routes(app)
        if self.admin is not None:
            self.admin.add_routes(app)
        if self.settings.access.guarded:
            app.middlewares.append(access_middleware(self.settings.access, self._refused))
        return app

    def _refused(self, status: int) -> None:
        self.metrics.responses.inc(status=str(status))

    async def health(self, request: web.Request) -> web.Response:
        """Anyone: the status. A request signed for GET /health: also every worker's state,
        with this router's proof that it holds the secret; a bad signature: 401."""
        ok = bool(self.pool.healthy("decode") or self.pool.healthy("collocated"))
        body: dict = {"status": "ok" if ok else "no worker can serve"}
        status, header = 200 if ok else 503, request.headers.get(AUTH_HEADER)
        if header is None:
            return web.json_response(body, status=status)
        try:
            self.auth.verify(request.method, request.path, header)
        except PeerRefused as e:
            error = ApiError(401, str(e), code="invalid_internal_auth")
            return web.json_response(error.body(), status=401)
        body["workers"] = [{"name": w.key, "url": w.url, "role": w.role, "state": w.state,
                            "healthy": w.healthy, "inflight": w.inflight, "refused": w.refused}
                           for w in self.pool.workers]
        raw = json.dumps(body).encode()
        return web.Response(body=raw, status=status, content_type="application/json",
                            headers={PROOF_HEADER: self.auth.proof(header, raw)})

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.metrics.refresh()
        return web.Response(body=self.metrics.registry.render().encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams
                        ) -> AsyncIterator[EventBatch | ResponseHeaders]:
        """The dispatcher's events, after the route header (path_choice.py) once the path is
        chosen."""
        chosen: list[Choice] = []
        try:
            async for batch in self.dispatcher.generate(request_id, prompt, params,
                                                        chosen.append):
                if chosen:
                    yield ResponseHeaders({ROUTE_HEADER: chosen.pop().header()})
                yield batch
        except LegFailed as e:
            raise GenerateError(str(e), e.status if e.client_error else 502) from e
        except NoWorkers as e:
            raise Overloaded(f"{e}.", 503, "no_workers", NO_WORKERS_RETRY_S) from e


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_log_level_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--secret-file", type=Path, required=True, metavar="FILE",
                   help="file holding the cluster secret (the workers' --secret-file): it signs "
                        "the router's health checks and leg channels, and a worker that cannot "
                        "prove it holds the same secret is never routed to")
    p.add_argument("--model", default="smollm2",
                   help="the model the workers serve: its tokenizer and chat template are "
                        "used here (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients use in 'model' (default: --model as given); must "
                        "match the workers'")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                   help="prefill worker base URLs, e.g. http://127.0.0.1:8001 (workers given "
                        "here are never removed from the pool, only marked unhealthy; with no "
                        "URL at all the router waits for workers started with --register)")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL",
                   help="decode worker base URLs")
    p.add_argument("--collocated", nargs="*", default=[], metavar="URL",
                   help="collocated worker base URLs")
    p.add_argument("--policy", default=PolicyName.LEAST_LOADED.value,
                   choices=[n.value for n in PolicyName],
                   help="how a worker is picked in each pool: round_robin, least_loaded (fewest "
                        "legs in flight), or prefix (longest cached prefix, then least loaded) "
                        "(default: %(default)s)")
    p.add_argument("--local-prefill-threshold", type=int, default=None, metavar="TOKENS",
                   help="a fixed rule: prompts whose uncached part is at most this many tokens "
                        "run whole on a decode worker, longer ones are split (default: decided "
                        "per request from measured costs: each path's queue and prefill rate, "
                        "the KV link's speed, and --slo-tpot-ms for the decode worker's streams; "
                        "256 until the rates are measured)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, metavar="MS",
                   help="time per output token the decode workers' streams should keep: a "
                        "decode worker prefills a prompt itself only if its steps stay under "
                        "this (default: %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to connect to a worker (default: %(default)s)")
    p.add_argument("--worker-grace", type=float, default=10.0, metavar="S",
                   help="seconds a worker that registered itself (pdserve worker --register) "
                        "may go without a heartbeat or an answered health check before it is "
                        "removed from the pool (default: %(default)s)")
    p.add_argument("--flip-timeout", type=float, default=300.0, metavar="S",
                   help="seconds the router waits for a worker to drain and switch roles when "
                        "asked to flip it (pdserve ctl flip), and for a worker to drain before "
                        "its cores are lent (pdserve ctl lend) (default: %(default)s)")
    p.add_argument("--leg-timeout", type=float, default=60.0,
                   help="seconds a leg may stay silent before it counts as failed; keep it "
                        "above the workers' --kv-lease, the longest a decode worker waits for "
                        "KV before it recomputes (default: %(default)s)")
    add_access_args(p)
    add_admission_args(p)
    add_limit_args(p)
    add_elastic_args(p)


def add_router_parser(subparsers: argparse._SubParsersAction) -> None:
    """`pdserve router`."""
    p = subparsers.add_parser(
        "router", help="the OpenAI-compatible front door over prefill/decode workers",
        description="Tokenizes, picks the path (whole on a decode or collocated worker when the "
                    "uncached prompt is short, else split into a prefill and a decode leg sent "
                    "at once) and streams one consistent token stream back.")
    add_router_args(p)
    p.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from pdserve.logs import setup

    settings = settings_from_args(args)
    setup(f"router:{settings.port}", log_level(args.log_level))
    asyncio.run(serve(settings))
    return 0


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """ValueError for a missing or short secret, a bad key or limit: before any model loads."""
    secret = read_secret_file(args.secret_file)
    access = access_from_args(args)
    dispatch = DispatchSettings(local_prefill_threshold=args.local_prefill_threshold,
                                slo_tpot_s=args.slo_tpot_ms / 1000.0,
                                connect_timeout_s=args.connect_timeout,
                                leg_timeout_s=args.leg_timeout)
    return RouterSettings(model=args.model, served_model_name=args.served_model_name,
                          host=args.host, port=args.port, prefill=tuple(args.prefill),
                          decode=tuple(args.decode), collocated=tuple(args.collocated),
                          policy=args.policy, dispatch=dispatch, access=access, secret=secret,
                          admission=admission_from_args(args), limits=limits_from_args(args),
                          worker_grace_s=args.worker_grace, flip_timeout_s=args.flip_timeout,
                          elastic=elastic_from_args(args))


async def serve(settings: RouterSettings) -> None:
    router = Router(settings)
    await router.start()
    runner = await start_site(router.app(), settings.host, settings.port)
    freeze_startup_heap()
    access = settings.access
    log.info("router listening on http://%s:%d/v1 (%d prefill, %d decode, %d collocated "
             "workers given, more may register; policy %s, %s, %s)", settings.host,
             settings.port, len(settings.prefill),
             len(settings.decode), len(settings.collocated), settings.policy,
             f"{len(access.api_keys)} API keys" if access.api_keys else "no API keys",
             f"rate limit {access.rate_limit.rate:g}/s burst {access.rate_limit.burst}"
             if access.rate_limit else "no rate limit")
    stop = stop_event()
    try:
        await stop.wait()
    finally:
        log.info("router stopping")
        await runner.cleanup()
        await router.stop()
