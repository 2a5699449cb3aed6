"""Cores lent between two real `pdserve worker` processes of one machine through a real router
(`POST /internal/workers/NAME/lend` and `/reclaim`, `router/core_lending.py`): a prefill worker
on core 0 lends it to a decode worker on core 1. Proves: every thread of the decode worker's
process then runs on cores 0-1 (the prefill worker's stay on 0), the router routes no prompt
to the lent worker (a split-size prompt is prefilled on the decode worker) and the greedy
tokens are those the split gave before; after the reclaim the decode worker's threads are
back on core 1, the prefill worker takes split prompts again (a prompt no worker has seen is
split; the first one, now in the decode worker's prefix cache, runs there) and the tokens of
the first are the same again. A router that stops while a loan stands leaves the decode
worker on both cores; the next router over the same workers pins it back to its own at once.
Skipped on a machine with fewer than two usable cores."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp

from pdserve.router.dispatch import DispatchSettings
from pdserve.router.path_choice import ROUTE_HEADER
from tests.router.test_registry_admin import call, router
from tests.serve.test_cpu_pin import _allowed, two_cores
from tests.serve.test_flip import AUTH, PROMPT, SECRET, serve_worker

THRESHOLD = 16  # PROMPT (37 tokens) is split while a prefill worker is routable
FRESH = list(range(60, 100))  # a prompt no worker has seen: split once the cores are back
SPLIT, LOCAL = "disaggregated; rule=threshold", "local; rule=no_prefill_worker"


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
    settings = {"secret": SECRET, "prefill": (pre_url,), "decode": (dec_url,),
                "dispatch": DispatchSettings(local_prefill_threshold=THRESHOLD)}
    async with router(model, **settings) as (r, base), aiohttp.ClientSession() as s:
        pre, dec = r.pool.workers
        assert (pre.role, dec.role) == ("prefill", "decode")
        assert r.pool.healthy("prefill") == [pre] and r.pool.healthy("decode") == [dec]
        assert (pre.info["cpus"], dec.info["cpus"]) == ([0], [1])
        assert pre.info["host"] == dec.info["host"]
        pre_pid, dec_pid = pre.info["pid"], dec.info["pid"]
        assert _allowed(pre_pid) == {"0"} and _allowed(dec_pid) == {"1"}
        route, before = await complete(s, base)
        assert route == SPLIT

        status, lent = await call(s, base, "POST", f"/internal/workers/{pre.key}/lend",
                                  {"to": dec.key}, AUTH)
        assert status == 200, lent
        assert (lent["worker"], lent["to"], lent["cpus"]) == (pre.key, dec.key, [0, 1])
        assert _allowed(dec_pid) == {"0-1"} and _allowed(pre_pid) == {"0"}
        await r.pool.refresh(r._session())  # the worker's own /health says so too
        assert dec.info["cpus"] == [0, 1] and pre.state == "lent"
        assert r.pool.healthy("prefill") == []
        status, workers = await call(s, base, "GET", "/internal/workers", auth=AUTH)
        assert status == 200
        assert [(w["name"], w["state"], w["cpus"], w["lent_to"]) for w in workers] == [
            (pre.key, "lent", [0], dec.key), (dec.key, "healthy", [0, 1], None)]
        route, during = await complete(s, base)
        assert (route, during) == (LOCAL, before)

        status, back = await call(s, base, "POST", f"/internal/workers/{pre.key}/reclaim",
                                  auth=AUTH)
        assert status == 200, back
        assert (back["from"], back["cpus"], back["pinned_back"]) == (dec.key, [0], True)
        assert _allowed(dec_pid) == {"1"} and _allowed(pre_pid) == {"0"}
        await r.pool.refresh(r._session())
        assert dec.info["cpus"] == [1] and dec.info["pid"] == dec_pid
        assert r.pool.healthy("prefill") == [pre] and pre.state == "healthy"
        route, after = await complete(s, base)  # cached on the decode worker now: local
        assert (route, after) == ("local; rule=threshold", before)
        assert (await complete(s, base, FRESH))[0] == SPLIT


async def restart_while_lent(model: Path, pre_url: str, dec_url: str) -> None:
    settings = {"secret": SECRET, "prefill": (pre_url,), "decode": (dec_url,)}
    async with router(model, **settings) as (r, base), aiohttp.ClientSession() as s:
        pre, dec = r.pool.workers
        status, lent = await call(s, base, "POST", f"/internal/workers/{pre.key}/lend",
                                  {"to": dec.key}, AUTH)
        assert (status, lent["cpus"]) == (200, [0, 1]), lent
        dec_pid = dec.info["pid"]
    assert _allowed(dec_pid) == {"0-1"}  # the router is gone; the pin stays
    async with router(model, **settings) as (r, base):
        pre, dec = r.pool.workers
        for _ in range(100):
            if _allowed(dec_pid) == {"1"}:
                break
            await asyncio.sleep(0.05)
        assert _allowed(dec_pid) == {"1"} and dec.info["pid"] == dec_pid
        await r.pool.refresh(r._session())
        assert (dec.info["cpus"], dec.info["own_cpus"]) == ([1], [1])
        assert r.admin.lending.loans == {} and r.pool.healthy("prefill") == [pre]


@two_cores
def test_a_prefill_workers_core_is_lent_to_a_decode_worker_and_given_back(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model()
    with serve_worker(model, tmp_path, "--role", "prefill", "--cpus", "0") as pre_url, \
            serve_worker(model, tmp_path, "--role", "decode", "--cpus", "1") as dec_url:
        asyncio.run(lend_and_reclaim(model, pre_url, dec_url))
        asyncio.run(restart_while_lent(model, pre_url, dec_url))
