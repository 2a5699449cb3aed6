"""The router's own `/health` over fake workers: anyone gets the status only; a request signed
with the cluster secret also gets every worker (healthy, and why it is refused) with the
router's proof; a bad or replayed signature is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth
from pdserve.router.app import Router, RouterSettings
from tests.http_app import serving
from tests.router.fake_worker import NAME, SECRET, FakeWorker, fake_workers, worker_info


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
               ) -> tuple[int, bytes, str | None]:
    async with session.get(url + "/health", headers=headers or {}) as r:
        return r.status, await r.read(), r.headers.get(PROOF_HEADER)


def test_health_lists_workers_and_refusals_only_to_a_signed_request(
        tiny_model: Callable[..., Path]) -> None:
    good, bad = FakeWorker(worker_info()), FakeWorker(worker_info(max_model_len=64))

    async def go() -> None:
        async with fake_workers(good, bad) as urls, aiohttp.ClientSession() as session:
            router = Router(RouterSettings(model=str(tiny_model()), served_model_name=NAME,
                                           decode=tuple(urls), secret=SECRET))
            await router.start()
            try:
                async with serving(router.app()) as url:
                    assert await _get(session, url) == (200, b'{"status": "ok"}', None)
                    auth = InternalAuth(SECRET)
                    headers = auth.headers("GET", "/health")
                    status, body, proof = await _get(session, url, headers)
                    assert status == 200
                    assert auth.check_proof(headers[AUTH_HEADER], body, proof)
                    workers = json.loads(body)["workers"]
                    assert [(w["url"], w["healthy"]) for w in workers] == [
                        (urls[0], True), (urls[1], False)]
                    assert workers[0]["refused"] is None
                    assert workers[1]["refused"].startswith(
                        "max_model_len 64 differs from the cluster's 512")
                    replayed = await _get(session, url, headers)
                    assert replayed[0] == 401 and b"replay" in replayed[1].lower()
                    forged = InternalAuth(b"y" * 32).headers("GET", "/health")
                    assert (await _get(session, url, forged))[0] == 401
            finally:
                await router.stop()

    asyncio.run(go())


def test_health_is_503_when_only_refused_workers_could_serve(
        tiny_model: Callable[..., Path]) -> None:
    async def go() -> None:
        async with fake_workers(FakeWorker(worker_info(model="other"))) as urls, \
                aiohttp.ClientSession() as session:
            router = Router(RouterSettings(model=str(tiny_model()), served_model_name=NAME,
                                           decode=tuple(urls), secret=SECRET))
            await router.start()
            try:
                async with serving(router.app()) as url:
                    assert await _get(session, url) == (
                        503, b'{"status": "no worker can serve"}', None)
            finally:
                await router.stop()

    asyncio.run(go())
