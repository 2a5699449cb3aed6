"""A worker process: HTTP server, engine thread, KV transfer endpoint.

Life cycle.
1. Pin to `--cpus` (compute threads = number of cores) and start the HTTP server at once:
   `/health` answers 503 while the model loads, so a supervisor can tell "loading" from
   "dead".
2. Load the engine, open the transport (every worker with the cluster secret, so that any
   role can change to one that moves KV; not a collocated worker on a GPU with the tcp
   transport, which moves host memory only), register the KV pool, start the engine thread;
   `/health` turns 200 and reports the transfer endpoint (`peer`) and the load the router
   routes on.
3. Serve: `GET /internal/legs` is a router's leg channel (a WebSocket that carries all its
   legs: `workers/leg_channel.py`); with `--serve-public` the OpenAI endpoints run LOCAL legs
   for any client. A client that disconnects, or a router that cancels a leg or closes its
   channel, cancels the legs. Who may reach which endpoint: `workers/access.py` (internal ones
   and the full `/health` need the cluster secret). `POST /internal/role` changes the role
   live, without reloading (`workers/role_endpoint.py`, `workers/role_flip.py`); the signed
   /health reports the current `role` and `state` ("serving" or "flipping").
   `POST /internal/cpus` changes the cores it computes on, between two steps
   (`workers/cpus_endpoint.py`, `workers/cpu_pin.py`); the signed /health reports `cpus`.
4. SIGTERM / SIGINT: stop accepting, stop the engine thread, close the transport, exit.
   Blocks held by unfinished legs die with the process; the peers see the transport close
   and free their side.
5. An engine that can no longer compute (a tensor-parallel rank died): every leg fails with
   the reason, then the worker stops as on SIGTERM and exits with status 1, its other ranks
   with it; `pdserve up` restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import torch
from aiohttp import web

from pdserve.api.errors import ApiError
from pdserve.api.http_site import start_site, stop_event
from pdserve.api.openai_server import GenerateError, OpenAIServer
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.parallel.cpu_split import pin_threads
from pdserve.heap import freeze_startup_heap
from pdserve.legs.protocol import LegRequest
from pdserve.metrics import CONTENT_TYPE
from pdserve.transfer.layout import KVLayout
from pdserve.workers.access import WorkerAccess
from pdserve.workers.cpu_pin import current_cpus, host_id
from pdserve.workers.cpus_endpoint import change_cpus
from pdserve.workers.engine_loop import EngineLoop, LegRefused
from pdserve.workers.hub_pump import HubPump
from pdserve.workers.leg_channel import WorkerLegChannels
from pdserve.workers.oneshot import run_once_in_thread
from pdserve.workers.register import Registration, start_registration
from pdserve.workers.role_endpoint import change_role
from pdserve.workers.settings import TransportName, WorkerSettings
from pdserve.workers.step_rates import SCAN, reported_rates
from pdserve.workers.step_trace import Step
from pdserve.workers.transfer_hub import TransferHub
from pdserve.workers.worker_metrics import WorkerMetrics

log = logging.getLogger("pdserve.worker")


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.metrics = WorkerMetrics(settings.role.value)
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None  # set last: the worker is ready from then on
        self.channels: WorkerLegChannels | None = None
        self.transport: Any = None
        self.access = WorkerAccess(settings.secret, settings.serve_public, settings.metrics_keys)
        self.kv_layout: dict[str, Any] | None = None  # the KV pool's, once loaded
        self.api = OpenAIServer(settings.served_model_name, None, self._max_model_len,
                                self._generate_local, limits=settings.limits)
        self.load_seconds: float | None = None
        self.pump: HubPump | None = None
        self.failed = asyncio.Event()  # the engine can no longer compute: the worker exits
        self.host = host_id()
        self.own_cpus = current_cpus()  # the cores it was started on (after `pin_cpus`)

    # -- start and stop ------------------------------------------------------------------------

    def load(self, aio: asyncio.AbstractEventLoop) -> None:
        """Runs in a thread while the HTTP server already answers /health with 503; the thread
        ends with it (`workers/oneshot.py`: one left alive with its OpenMP team halved the
        engine's speed)."""
        t0 = time.perf_counter()
        s = self.settings
        self.engine = Engine(s.engine)
        layout = KVLayout.of_cache(self.engine.kv_cache, s.served_model_name)
        self.kv_layout = layout.to_json()
        hub = None
        if _moves_kv(s):
            self.transport = _open_transport(s)
            self.transport.register(self.engine.kv_cache)
            self.metrics.bind_transport(self.transport.peers_lost)
            hub = HubPump(TransferHub(self.transport, self.engine.kv_cache, layout,
                                      self.engine.block_generation, s.kv_lease_s))
            hub.start()
        self.pump = hub
        loop = EngineLoop(self.engine, hub, self.metrics, stream_layers=s.stream_layers,
                          tpot_target_s=s.tpot_target_s, itl_target_s=s.itl_target_s,
                          ttft_target_s=s.ttft_target_s,
                          on_fatal=lambda _: aio.call_soon_threadsafe(self.failed.set))
        self.metrics.bind_engine(self.engine, lambda: loop.num_legs)
        self.api.tokenizer = self.engine.tokenizer
        self.channels = WorkerLegChannels(loop)
        freeze_startup_heap()
        loop.start(aio)
        self.loop = loop
        self.load_seconds = time.perf_counter() - t0
        peer = f", KV endpoint {self.transport.local.host}:{self.transport.local.port}" \
            if self.transport else ""
        log.info("%s worker ready in %.1f s (model %s%s)", s.role.value, self.load_seconds,
                 s.served_model_name, peer)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.pump is not None:
            self.pump.stop()
        if self.transport is not None:
            self.transport.close()
        if self.engine is not None:  # a tensor-parallel engine's ranks stop with it
            self.engine.close()

    @property
    def ready(self) -> bool:
        return self.loop is not None

    def _max_model_len(self) -> int | None:
        return self.engine.config.max_model_len if self.engine else None

    # -- HTTP ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.limits.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/internal/legs", self.legs)
        app.router.add_get("/internal/steps", self.steps)
        app.router.add_post("/internal/role", self.change_role)
        app.router.add_post("/internal/cpus", self.change_cpus)
        self.api.add_routes(app)
        app.middlewares.append(self.access.middleware())  # first: refusals before anything
        app.middlewares.append(_not_ready_guard(self))
        app.on_shutdown.append(self._close_channels)
        return app

    async def health(self, request: web.Request) -> web.Response:
        """Liveness for anyone; the full info, proved, for a request signed with the secret."""
        status, body = (200, {"status": "ok"}) if self.ready else (503, {"status": "loading"})
        if not self.access.signed(request):
            return web.json_response(body, status=status)
        return self.access.signed_json(request, self.info() if self.ready else body, status)

    def info(self) -> dict[str, Any]:
        e, load = self.engine, self.engine.load()
        return {
            "status": "ok", "role": e.role.value, "state": self.loop.flip.state,
            "model": self.settings.served_model_name, "max_model_len": e.config.max_model_len,
            "block_size": e.config.block_size, "dtype": e.config.dtype,
            "max_num_seqs": e.config.max_num_seqs,
            "kv_layout": self.kv_layout,
            "peer": self.transport.local.to_json() if self.transport else None,
            # what the transport measured of each link it moved KV on (transfer/link_report.py)
            "links": [r.to_json() for r in self.transport.links()] if self.transport else [],
            "kv_blocks_total": load.kv_blocks_total, "kv_blocks_used": load.kv_blocks_used,
            "running": load.running, "waiting": load.waiting,
            "waiting_for_kv": load.waiting_for_kv, "legs": self.loop.num_legs,
            "load_seconds": self.load_seconds, "pid": os.getpid(),
            # the cores it computes on now (`--cpus`, or a later POST /internal/cpus)
            "cpus": current_cpus(),
            # the cores it was started on: a router that finds it on others, with no loan of
            # its own making, pins it back to these (`router/core_lending.py`)
            "own_cpus": self.own_cpus,
            # the machine those core numbers are on (cores are lent only within one)
            "host": self.host,
            "rates": reported_rates(self.loop.trace.newest_first(SCAN)).to_json(),
            "chunk_tokens": e.prefill_chunk or (e.config.max_num_batched_tokens
                                                if e.config.enable_chunked_prefill else None),
            # the chunk above is paced to this TPOT target (--slo-tpot-ms; a step within it, or
            # within --slo-itl-ms while the streams' credit lasts: workers/prefill_budget.py)
            "chunk_tpot_s": self.loop.pacer.tpot_target_s
            if self.loop.pacer is not None and e.prefill_chunk is not None else None,
        }

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.registry.render().encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def steps(self, request: web.Request) -> web.Response:
        """Engine steps that ended after `?since=` (wall-clock seconds; default: all kept), with
        the worker's proof of the secret (the access middleware let only signed requests in).
        Body: "role" and "role_since" (the current role, since when), "fields" (`Step._fields`),
        "steps" (one list per step, oldest first), "roles" (the role in force at `since` and
        each change after it, oldest first: {"role", "since", "from", "flip_seconds"},
        `workers/role_history.py`; "from" and "flip_seconds" are null for the role the worker
        started in)."""
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            return web.json_response(ApiError(400, "since must be a number of seconds").body(),
                                     status=400)
        steps = self.loop.trace.since(since)
        return self.access.signed_json(request, {  # steps before role_since ran in another role
            "role": self.engine.role.value, "role_since": self.loop.flip.role_since,
            "fields": list(Step._fields),
            "steps": [list(s) for s in steps],
            "roles": [span.to_json() for span in self.loop.flip.history.since(since)]})

    async def change_role(self, request: web.Request) -> web.Response:
        return await change_role(request, self.loop, self.access)

    async def change_cpus(self, request: web.Request) -> web.Response:
        return await change_cpus(request, self.loop, self.access)

    async def legs(self, request: web.Request) -> web.WebSocketResponse:
        return await self.channels.serve(request)

    async def _close_channels(self, app: web.Application) -> None:
        if self.channels is not None:
            await self.channels.close_all()

    async def _generate_local(self, request_id: str, prompt: list[int],
                              params: SamplingParams):
        sink = self.loop.submit(LegRequest(request_id, tuple(prompt), params))
        try:
            async with contextlib.aclosing(self.loop.events(request_id, sink)) as legs:
                async for events in legs:
                    yield events
        except LegRefused as e:  # 503: a worker changing role, try again or elsewhere
            raise GenerateError(str(e), status=503 if e.unavailable else 400) from e


def _not_ready_guard(worker: Worker):
    @web.middleware
    async def guard(request: web.Request, handler):
        if not worker.ready and request.path not in ("/health", "/metrics"):
            return web.json_response(ApiError(503, "the model is still loading").body(),
                                     status=503)
        return await handler(request)

    return guard


def _moves_kv(s: WorkerSettings) -> bool:
    """Whether the worker opens a KV transfer endpoint: needed in the prefill and decode roles,
    and opened in the collocated one too so that it can change to them (one idle endpoint and
    its poller), where the cluster secret exists and the transport can reach the pool."""
    tcp_on_gpu = s.transport is TransportName.TCP and s.engine.device.startswith("cuda")
    return s.needs_transport or (s.secret is not None and not tcp_on_gpu)


def _open_transport(s: WorkerSettings):
    if s.transport is TransportName.NIXL:
        from pdserve.transfer.nixl import NixlTransport

        return NixlTransport(s.kv_host, s.kv_port, secret=s.secret,
                             advertise_host=s.kv_advertise)
    from pdserve.transfer.tcp import TcpOptions, TcpTransport

    return TcpTransport(s.kv_host, s.kv_port, secret=s.secret, advertise_host=s.kv_advertise,
                        options=TcpOptions(encrypt=s.kv_encrypt, congestion=s.kv_congestion))


def pin_cpus(cpus: tuple[int, ...] | None) -> None:
    if cpus is not None:
        pin_threads(cpus)
        torch.set_num_threads(len(cpus))


async def serve(settings: WorkerSettings) -> int:
    """Run one worker until SIGTERM or SIGINT (then 0), or until its engine fails for good
    (then 1: a supervisor restarts it)."""
    pin_cpus(settings.cpus)
    worker = Worker(settings)
    runner = await start_site(worker.app(), settings.host, settings.port)
    log.info("%s worker listening on http://%s:%d (loading %s)", settings.role.value,
             settings.host, settings.port, settings.engine.model)
    stop = stop_event()
    loading = asyncio.ensure_future(run_once_in_thread(worker.load, asyncio.get_running_loop(),
                                                       name="load"))
    registration: Registration | None = None  # --register: joined once loaded
    try:
        done, _ = await asyncio.wait({loading, asyncio.ensure_future(stop.wait())},
                                     return_when=asyncio.FIRST_COMPLETED)
        if loading in done:
            loading.result()  # raises a load error (bad model folder...)
            registration = start_registration(settings.join, settings.secret, worker.info)
            await asyncio.wait({asyncio.ensure_future(stop.wait()),
                                asyncio.ensure_future(worker.failed.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("worker stopping")
        if registration is not None:  # drains through the router, then leaves its pool
            await registration.leave()
        with contextlib.suppress(Exception):
            await runner.cleanup()
        worker.close()
    return 1 if worker.failed.is_set() else 0
