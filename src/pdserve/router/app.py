"""The router process: the OpenAI front door over prefill, decode and collocated workers.

Life cycle.
1. Load the tokenizer (the router renders chat templates and tokenizes; workers only ever see
   token ids), start the HTTP server and the health watcher (every worker's `/health` once a
   second: readiness, transfer endpoint, load).
2. Serve. `/health` is 200 while some worker can finish a request (a decode or collocated
   worker is healthy). Requests go through `Dispatcher`; one request id (`cmpl-...`,
   `chatcmpl-...`) names the request in the router's, the prefill's and the decode's logs.
3. SIGTERM / SIGINT: stop accepting; in-flight handlers are cancelled, which closes their
   legs, which the workers cancel.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from pdserve.api.http_site import start_site, stop_event
from pdserve.api.legs import EventBatch
from pdserve.api.openai_server import GenerateError, OpenAIServer
from pdserve.engine.model.hub import load_tokenizer, resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.heap import freeze_startup_heap
from pdserve.metrics import CONTENT_TYPE
from pdserve.router.dispatch import Dispatcher, DispatchSettings, NoWorkers
from pdserve.router.leg_client import LegChannels, LegFailed
from pdserve.router.policies import PolicyName, make_policy
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerPool

log = logging.getLogger("pdserve.router")


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

    def __post_init__(self) -> None:
        make_policy(self.policy)  # raises ValueError for an unknown name
        if not (self.decode or self.collocated):
            raise ValueError("the router needs at least one --decode or --collocated worker")
        if self.prefill and not self.decode:
            raise ValueError("--prefill workers need at least one --decode worker")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.pool = WorkerPool({"prefill": list(settings.prefill),
                                "decode": list(settings.decode),
                                "collocated": list(settings.collocated)})
        self.metrics.bind_pool(self.pool)
        tokenizer = load_tokenizer(resolve_model(settings.model))
        self.api = OpenAIServer(settings.name, tokenizer, self._max_model_len, self._generate,
                                self.metrics)
        self.session: aiohttp.ClientSession | None = None
        self.channels: LegChannels | None = None
        self.dispatcher: Dispatcher | None = None

    def _max_model_len(self) -> int | None:
        info = self.pool.model_info
        return info["max_model_len"] if info else None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector)
        self.channels = LegChannels(self.session, self.settings.dispatch.connect_timeout_s)
        self.dispatcher = Dispatcher(self.pool, make_policy(self.settings.policy),
                                     self.settings.dispatch, self.channels, self.metrics)
        await self.pool.refresh(self.session)
        self.pool.start(self.session)

    async def stop(self) -> None:
        await self.pool.stop()
        if self.channels is not None:
            await self.channels.close()
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        self.api.add_routes(app)
        return app

    async def health(self, request: web.Request) -> web.Response:
        workers = [{"url": w.url, "role": w.role, "healthy": w.healthy, "inflight": w.inflight}
                   for w in self.pool.workers]
        ok = bool(self.pool.healthy("decode") or self.pool.healthy("collocated"))
        return web.json_response({"status": "ok" if ok else "no worker can serve",
                                  "workers": workers}, status=200 if ok else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.metrics.refresh()
        return web.Response(body=self.metrics.registry.render().encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams
                        ) -> AsyncIterator[EventBatch]:
        try:
            async for batch in self.dispatcher.generate(request_id, prompt, params):
                yield batch
        except LegFailed as e:
            raise GenerateError(str(e), e.status if e.client_error else 502) from e
        except NoWorkers as e:
            raise GenerateError(str(e), 503) from e


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--model", default="smollm2",
                   help="the model the workers serve: its tokenizer and chat template are "
                        "used here (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients use in 'model' (default: --model as given); must "
                        "match the workers'")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                   help="prefill worker base URLs, e.g. http://127.0.0.1:8001")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL",
                   help="decode worker base URLs")
    p.add_argument("--collocated", nargs="*", default=[], metavar="URL",
                   help="collocated worker base URLs")
    p.add_argument("--policy", default=PolicyName.LEAST_LOADED.value,
                   choices=[n.value for n in PolicyName],
                   help="how a worker is picked in each pool: round_robin, least_loaded (fewest "
                        "legs in flight), or prefix (longest cached prefix, then least loaded) "
                        "(default: %(default)s)")
    p.add_argument("--local-prefill-threshold", type=int, default=256,
                   help="prompts whose uncached part is at most this many tokens run whole on "
                        "a decode worker instead of being split (default: %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to connect to a worker (default: %(default)s)")
    p.add_argument("--leg-timeout", type=float, default=60.0,
                   help="seconds a leg may stay silent before it counts as failed; keep it "
                        "above the workers' --kv-lease, the longest a decode worker waits for "
                        "KV before it recomputes (default: %(default)s)")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    dispatch = DispatchSettings(local_prefill_threshold=args.local_prefill_threshold,
                                connect_timeout_s=args.connect_timeout,
                                leg_timeout_s=args.leg_timeout)
    return RouterSettings(model=args.model, served_model_name=args.served_model_name,
                          host=args.host, port=args.port, prefill=tuple(args.prefill),
                          decode=tuple(args.decode), collocated=tuple(args.collocated),
                          policy=args.policy, dispatch=dispatch)


async def serve(settings: RouterSettings) -> None:
    router = Router(settings)
    await router.start()
    runner = await start_site(router.app(), settings.host, settings.port)
    freeze_startup_heap()
    log.info("router listening on http://%s:%d/v1 (%d prefill, %d decode, %d collocated "
             "workers, policy %s)", settings.host, settings.port, len(settings.prefill),
             len(settings.decode), len(settings.collocated), settings.policy)
    stop = stop_event()
    try:
        await stop.wait()
    finally:
        log.info("router stopping")
        await runner.cleanup()
        await router.stop()
