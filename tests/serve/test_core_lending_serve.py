"""Cores lent between two real `pdserve worker` processes of one machine through a real router
(`POST /internal/workers/NAME/lend` and `/reclaim`, `router/core_lending.py`): a prefill worker
on core 0 lends it to a decode worker on core 1. Proves: every thread of the decode worker's
process then runs on cores 0-1 (the prefill worker's stay on 0), the router routes no prompt
to the lent worker (a split-size prompt is prefilled on the decode worker) and the greedy
tokens are those the split gave before; after the reclaim the decode worker's threads are
back on core 1, the prefill worker takes split prompts again (a prompt no worker has seen is
split; the first one, now in the decode worker's prefix cache, runs there) and the tokens of
the first are the same again. Skipped on a machine with fewer than two usable cores."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER
from pdserve.router.app import Router, RouterSettings
from pdserve.router.dispatch import DispatchSettings
from pdserve.router.path_choice import ROUTE_HEADER
from tests.http_app import serving
from tests.serve.test_cpu_pin import _allowed, two_cores
from tests.serve.test_flip import AUTH, PROMPT, SECRET, serve_worker

THRESHOLD = 16  # PROMPT (37 tokens) is split while a prefill worker is routable
FRESH = list(range(60, 100))  # a prompt no worker has seen: split once the cores are back
SPLIT, LOCAL = "disaggregated; rule=threshold", "local; rule=no_prefill_worker"


@contextlib.asynccontextmanager
async def router(model: Path, prefill: str, decode: str) -> AsyncIterator[tuple[Router, str]]:
    r = Router(RouterSettings(model=str(model), served_model_name="tiny", secret=SECRET,
                              prefill=(prefill,), decode=(decode,),
                              dispatch=DispatchSettings(local_prefill_threshold=THRESHOLD)))
    await r.start()
    try:
        async with serving(r.app()) as url:
            yield r, url
    finally:
        await r.stop()


async def signed(s: aiohttp.ClientSession, base: str, method: str, path: str,
                 body: object = None) -> tuple[int, Any]:
    """A call to the router's /internal/ endpoints; its answer must prove the secret."""
    headers = AUTH.headers(method, path)
    async with s.request(method, base + path, json=body, headers=headers) as resp:
        raw = await resp.read()
        assert AUTH.check_proof(headers[AUTH_HEADER], raw, resp.headers.get(PROOF_HEADER))
        return resp.status, json.loads(raw)


async def complete(s: aiohttp.ClientSession, base: str, prompt: list[int] = PROMPT
                   ) -> tuple[str, list[dict]]:
    """A greedy completion of `prompt` through the router: its route and its choices."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    async with s.post(base + "/v1/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return resp.headers[ROUTE_HEADER], answer["choices"]


async def lend_and_reclaim(model: Path, pre_url: str, dec_url: str) -> None:
    async with router(model, pre_url, dec_url) as (r, base), aiohttp.ClientSession() as s:
        pre, dec = r.pool.workers
        assert (pre.role, dec.role) == ("prefill", "decode")
        assert r.pool.healthy("prefill") == [pre] and r.pool.healthy("decode") == [dec]
        assert (pre.info["cpus"], dec.info["cpus"]) == ([0], [1])
        assert pre.info["host"] == dec.info["host"]
        pre_pid, dec_pid = pre.info["pid"], dec.info["pid"]
        assert _allowed(pre_pid) == {"0"} and _allowed(dec_pid) == {"1"}
        route, before = await complete(s, base)
        assert route == SPLIT

        status, lent = await signed(s, base, "POST", f"/internal/workers/{pre.key}/lend",
                                    {"to": dec.key})
        assert status == 200, lent
        assert (lent["worker"], lent["to"], lent["cpus"]) == (pre.key, dec.key, [0, 1])
        assert _allowed(dec_pid) == {"0-1"} and _allowed(pre_pid) == {"0"}
        await r.pool.refresh(r._session())  # the worker's own /health says so too
        assert dec.info["cpus"] == [0, 1] and pre.state == "lent"
        assert r.pool.healthy("prefill") == []
        status, workers = await signed(s, base, "GET", "/internal/workers")
        assert status == 200
        assert [(w["name"], w["state"], w["cpus"], w["lent_to"]) for w in workers] == [
            (pre.key, "lent", [0], dec.key), (dec.key, "healthy", [0, 1], None)]
        route, during = await complete(s, base)
        assert (route, during) == (LOCAL, before)

        status, back = await signed(s, base, "POST", f"/internal/workers/{pre.key}/reclaim")
        assert status == 200, back
        assert (back["from"], back["cpus"], back["pinned_back"]) == (dec.key, [0], True)
        assert _allowed(dec_pid) == {"1"} and _allowed(pre_pid) == {"0"}
        await r.pool.refresh(r._session())
        assert dec.info["cpus"] == [1] and dec.info["pid"] == dec_pid
        assert r.pool.healthy("prefill") == [pre] and pre.state == "healthy"
        route, after = await complete(s, base)  # cached on the decode worker now: local
        assert (route, after) == ("local; rule=threshold", before)
        assert (await complete(s, base, FRESH))[0] == SPLIT


@two_cores
def test_a_prefill_workers_core_is_lent_to_a_decode_worker_and_given_back(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model()
    with serve_worker(model, tmp_path, "--role", "prefill", "--cpus", "0") as pre_url, \
            serve_worker(model, tmp_path, "--role", "decode", "--cpus", "1") as dec_url:
        asyncio.run(lend_and_reclaim(model, pre_url, dec_url))
