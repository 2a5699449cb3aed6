"""Admission behind the real OpenAI endpoints over HTTP: a refusal is a 429 with Retry-After
and OpenAI's error JSON, and a client that disconnects while queued leaves the queue (its
handler is cancelled) without ever holding a slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from pdserve.api.openai_server import OpenAIServer
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import TokenEvent
from pdserve.router.admission import AdmissionQueue
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle
from pdserve.testing.tiny_models import tiny_tokenizer
from tests.http_app import serving

MODEL = "tiny"
BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "stream": True}


async def until(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_refusal_over_http_and_a_queued_client_that_leaves() -> None:
    async def go() -> None:
        a = WorkerHandle("http://a", "decode", healthy=True)
        metrics = RouterMetrics()
        q = AdmissionQueue("decode", lambda: [a], AdmissionSettings(
            max_queue=1, max_inflight_per_worker=1), metrics)
        finish = asyncio.Event()
        served: list[str] = []

        async def generate(request_id: str, prompt: list[int], params: SamplingParams
                           ) -> AsyncIterator[TokenEvent]:
            slot = await q.acquire(lambda free: free[0], len(prompt))
            served.append(request_id)
            try:
                await finish.wait()
                yield TokenEvent(0, [100], 0, "x", finish_reason="length",
                                 prompt_tokens=len(prompt), final=True)
            finally:
                slot.release(1)

        app = web.Application()
        OpenAIServer(MODEL, tiny_tokenizer(), lambda: 512, generate, metrics).add_routes(app)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            url = base + "/v1/completions"

            async def post() -> tuple[int, bytes]:
                async with session.post(url, json=BODY) as resp:
                    return resp.status, await resp.read()

            first = asyncio.create_task(post())
            await until(lambda: q.held(a) == 1, "the first request holds the slot")
            queued = asyncio.create_task(post())
            await until(lambda: q.depth == 1, "the second request waits")
            async with session.post(url, json=BODY) as resp:
                status, headers, error = resp.status, resp.headers, await resp.json()
            assert status == 429
            assert headers["Retry-After"].isdigit() and int(headers["Retry-After"]) >= 1
            assert error["error"]["code"] == "queue_full"
            assert error["error"]["type"] == "server_error"
            assert error["error"]["message"].startswith("All decode workers are busy")
            queued.cancel()  # the client goes away: its connection closes
            await asyncio.gather(queued, return_exceptions=True)
            await until(lambda: q.depth == 0, "the queued request left")
            finish.set()
            assert (await first)[0] == 200
            assert len(served) == 1 and q.held(a) == 0
            assert metrics.responses.value(status="429") == 1

    asyncio.run(go())


def test_every_admitted_request_is_served_in_arrival_order() -> None:
    async def go() -> None:
        a = WorkerHandle("http://a", "decode", healthy=True)
        q = AdmissionQueue("decode", lambda: [a], AdmissionSettings(
            max_queue=8, max_inflight_per_worker=1))
        order: list[int] = []

        async def generate(request_id: str, prompt: list[int], params: SamplingParams
                           ) -> AsyncIterator[TokenEvent]:
            slot = await q.acquire(lambda free: free[0], len(prompt))
            order.append(prompt[0])
            try:
                await asyncio.sleep(0.01)
                yield TokenEvent(0, [100], 0, "x", finish_reason="length",
                                 prompt_tokens=len(prompt), final=True)
            finally:
                slot.release(1)

        app = web.Application()
        OpenAIServer(MODEL, tiny_tokenizer(), lambda: 512, generate).add_routes(app)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            async def post(i: int) -> int:
                async with session.post(base + "/v1/completions",
                                        json={**BODY, "prompt": [i, 2]}) as resp:
                    await resp.read()
                    return resp.status

            tasks = []
            for i in range(1, 6):
                tasks.append(asyncio.create_task(post(i)))
                await until(lambda n=i: len(order) + q.depth == n, f"request {i} arrived")
            assert await asyncio.gather(*tasks) == [200] * 5
        assert order == [1, 2, 3, 4, 5]

    asyncio.run(go())
