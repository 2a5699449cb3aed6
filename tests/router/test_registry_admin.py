"""The router's signed admin endpoints (`router/admin.py`) on a real router with no worker on
its command line, workers being fake HTTP servers: joins, the listing, heartbeats, leaving,
and role flips against a worker that keeps the `/internal/role` contract (200 once drained and
switched, 409 same role, 503 drain timed out); every refusal changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth, PeerRefused
from pdserve.router.app import Router, RouterSettings
from tests.http_app import serving
from tests.router.fake_worker import NAME, SECRET, FakeWorker, worker_info

AUTH = InternalAuth(SECRET)


class FlippingWorker(FakeWorker):
    """A fake worker whose signed `POST /internal/role` switches the role its /health reports
    (`answer`: a status to give instead, with the role unchanged)."""

    def __init__(self, info: dict[str, Any], answer: int = 200) -> None:
        super().__init__(info)
        self.answer, self.flips = answer, 0
        # False: its answers to /internal/ POSTs carry no proof (an impostor's: nothing changes)
        self.prove_changes = True

    async def role(self, request: web.Request) -> web.Response:
        if (refused := self.unsigned(request)) is not None:
            return refused
        header = request.headers[AUTH_HEADER]
        new, old = (await request.json())["role"], self.info["role"]
        self.flips += 1
        if new == old:
            return self.answered(header, {"error": {"message": f"already {new}"}}, 409)
        if self.answer != 200:
            return self.answered(header, {"error": {"message": "draining timed out after 1 s"}},
                                 self.answer)
        if self.prove_changes:  # else: an impostor answered, the worker changed nothing
            self.info = dict(self.info, role=new)
        return self.answered(header, {"from": old, "to": new, "seconds": 0.5})

    @staticmethod
    def unsigned(request: web.Request) -> web.Response | None:
        """The worker's 401 for a request without a valid signature; None when signed."""
        try:
            AUTH.verify(request.method, request.path, request.headers.get(AUTH_HEADER))
        except PeerRefused as e:
            return web.json_response({"error": {"message": str(e)}}, status=401)
        return None

    def answered(self, header: str, obj: object, status: int = 200) -> web.Response:
        """A worker's answer to a signed request, with its proof of the secret (unless
        `prove_changes` is off)."""
        body = json.dumps(obj).encode()
        proof = {PROOF_HEADER: AUTH.proof(header, body)} if self.prove_changes else {}
        return web.Response(body=body, status=status, content_type="application/json",
                            headers=proof)


@contextlib.asynccontextmanager
async def workers(*fakes: FlippingWorker) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for fake in fakes:
            app = web.Application()
            app.router.add_get("/health", fake.health)
            app.router.add_post("/internal/role", fake.role)
            urls.append(await stack.enter_async_context(serving(app)))
        yield urls


@contextlib.asynccontextmanager
async def router(model: Path, **settings: Any) -> AsyncIterator[tuple[Router, str]]:
    """A started router serving `model` as NAME with SECRET, unless `settings` say otherwise."""
    r = Router(RouterSettings(**{"model": str(model), "served_model_name": NAME,
                                 "secret": SECRET, **settings}))
    await r.start()
    try:
        async with serving(r.app()) as url:
            yield r, url
    finally:
        await r.stop()


async def call(session: aiohttp.ClientSession, base: str, method: str, path: str,
               body: object = None, auth: InternalAuth | None = AUTH) -> tuple[int, Any]:
    """A signed call (unsigned with auth None); a signed answer must carry the proof."""
    headers = auth.headers(method, path) if auth else {}
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    async with session.request(method, base + path, data=data, headers=headers) as r:
        raw = await r.read()
        if auth is not None and r.status != 401:
            assert auth.check_proof(headers[AUTH_HEADER], raw, r.headers.get(PROOF_HEADER))
        return r.status, json.loads(raw)


def card(name: str, url: str, role: str = "decode") -> dict[str, Any]:
    return {"name": name, "url": url, "role": role, "kv_endpoint": None}


def run(tiny_model: Callable[..., Path], fakes: list[FlippingWorker], body) -> None:
    async def go() -> None:
        async with workers(*fakes) as urls, router(tiny_model()) as (r, base), \
                aiohttp.ClientSession() as session:
            await body(r, base, urls, session)

    asyncio.run(go())


def test_every_admin_endpoint_needs_a_fresh_signature(tiny_model: Callable[..., Path]) -> None:
    async def body(r: Router, base: str, urls: list[str], s: aiohttp.ClientSession) -> None:
        requests = [("GET", "/internal/workers", None), ("POST", "/internal/workers", card(
            "w1", urls[0])), ("PUT", "/internal/workers/w1", None),
            ("DELETE", "/internal/workers/w1", None),
            ("POST", "/internal/workers/w1/flip", {"role": "prefill"})]
        for method, path, payload in requests:
            for auth in (None, InternalAuth(b"x" * 32)):
                status, error = await call(s, base, method, path, payload, auth)
                assert status == 401, (method, path)
                assert error["error"]["code"] == "invalid_internal_auth"
        assert r.pool.workers == []
        headers = AUTH.headers("GET", "/internal/workers")
        assert (await call(s, base, "GET", "/internal/workers")) == (200, [])
        async with s.get(base + "/internal/workers", headers=headers) as first:
            assert first.status == 200
        async with s.get(base + "/internal/workers", headers=headers) as replayed:
            assert replayed.status == 401 and "replay" in (await replayed.text()).lower()
        signed_elsewhere = AUTH.headers("GET", "/health")
        async with s.get(base + "/internal/workers", headers=signed_elsewhere) as other:
            assert other.status == 401
        assert (await call(s, base, "GET", "/internal/nothing"))[0] == 404
        async with s.get(base + "/health") as health:  # nobody yet: nothing can serve
            assert health.status == 503

    run(tiny_model, [FlippingWorker(worker_info())], body)


def test_join_list_heartbeat_and_leave(tiny_model: Callable[..., Path]) -> None:
    async def body(r: Router, base: str, urls: list[str], s: aiohttp.ClientSession) -> None:
        assert await call(s, base, "POST", "/internal/workers", card("w1", urls[0])) == (
            201, {"name": "w1", "role": "decode", "state": "healthy"})
        assert await call(s, base, "POST", "/internal/workers", card("w1", urls[0])) == (
            200, {"name": "w1", "role": "decode", "state": "healthy"})
        status, error = await call(s, base, "POST", "/internal/workers", card("w1", urls[1]))
        assert status == 409 and error["error"]["code"] == "duplicate_worker"
        status, error = await call(s, base, "POST", "/internal/workers", card("w2", urls[1]))
        assert status == 422 and error["error"]["message"] == (
            "worker w2 refused: max_model_len 64 differs from the cluster's 512 (set by the "
            "first worker accepted)")
        status, error = await call(s, base, "POST", "/internal/workers", b"[")
        assert status == 400
        r.dispatcher.queues["decode"].hold(r.pool.workers[0])  # one request in flight there
        assert await call(s, base, "GET", "/internal/workers") == (200, [{
            "name": "w1", "url": urls[0], "role": "decode", "state": "healthy",
            "registered": True, "queue": 1, "legs": 0, "kv_blocks_used": 0,
            "kv_blocks_total": 64, "kv_endpoint": None, "refused": None, "cpus": None,
            "lent_to": None}])
        async with s.get(base + "/health") as health:
            assert health.status == 200
        assert await call(s, base, "PUT", "/internal/workers/w1", {"state": "draining"}) == (
            200, {"name": "w1", "state": "draining"})
        assert r.pool.healthy("decode") == []
        assert (await call(s, base, "PUT", "/internal/workers/w9", {}))[0] == 404
        assert await call(s, base, "DELETE", "/internal/workers/w1") == (
            200, {"name": "w1", "removed": True})
        assert await call(s, base, "GET", "/internal/workers") == (200, [])
        assert (await call(s, base, "DELETE", "/internal/workers/w1"))[0] == 404
        text = r.metrics.registry.render()
        for line in ('pdserve_router_worker_registrations_total{result="accepted"} 1',
                     'pdserve_router_worker_registrations_total{result="rejoined"} 1',
                     'pdserve_router_worker_registrations_total{result="duplicate_worker"} 1',
                     'pdserve_router_worker_registrations_total{result="incompatible_worker"} 1',
                     'pdserve_router_worker_removals_total{reason="deregistered"} 1',
                     'pdserve_worker_role{worker="w1",role="decode"} 0'):
            assert line in text, line

    run(tiny_model, [FlippingWorker(worker_info()),
                     FlippingWorker(worker_info(max_model_len=64))], body)


def test_a_flip_drains_switches_and_routes_the_worker_in_its_new_role(
        tiny_model: Callable[..., Path]) -> None:
    fake = FlippingWorker(worker_info("collocated"))

    async def body(r: Router, base: str, urls: list[str], s: aiohttp.ClientSession) -> None:
        await call(s, base, "POST", "/internal/workers", card("w1", urls[0], "collocated"))
        status, result = await call(s, base, "POST", "/internal/workers/w1/flip",
                                    {"role": "decode"})
        assert status == 200, result
        assert (result["worker"], result["from"], result["to"]) == ("w1", "collocated",
                                                                    "decode")
        assert result["seconds"] >= 0
        assert r.pool.healthy("decode") == r.pool.workers and r.pool.healthy("collocated") == []
        r.metrics.refresh()
        text = r.metrics.registry.render()
        for line in ('pdserve_role_flips_total{from="collocated",to="decode"} 1',
                     'pdserve_worker_role{worker="w1",role="decode"} 1',
                     'pdserve_worker_role{worker="w1",role="collocated"} 0'):
            assert line in text, line

    run(tiny_model, [fake], body)
    assert fake.flips == 1 and fake.info["role"] == "decode"


@pytest.mark.parametrize(("answer", "status"), [(503, 503), (500, 502)])
def test_a_flip_the_worker_refuses_leaves_its_role(tiny_model: Callable[..., Path],
                                                   answer: int, status: int) -> None:
    async def body(r: Router, base: str, urls: list[str], s: aiohttp.ClientSession) -> None:
        await call(s, base, "POST", "/internal/workers", card("w1", urls[0]))
        got, error = await call(s, base, "POST", "/internal/workers/w1/flip",
                                {"role": "prefill"})
        assert got == status and error["error"]["message"] == (
            f"worker w1 refused the flip ({answer}): draining timed out after 1 s (its role is "
            "still decode)")
        assert (await call(s, base, "GET", "/internal/workers"))[1][0]["state"] == "healthy"
        assert r.pool.healthy("decode") == r.pool.workers

    run(tiny_model, [FlippingWorker(worker_info(), answer=answer)], body)


def test_flips_that_are_refused_change_nothing(tiny_model: Callable[..., Path]) -> None:
    fakes = [FlippingWorker(worker_info()), FlippingWorker(worker_info("prefill"))]

    async def body(r: Router, base: str, urls: list[str], s: aiohttp.ClientSession) -> None:
        await call(s, base, "POST", "/internal/workers", card("dec", urls[0]))
        await call(s, base, "POST", "/internal/workers", card("pre", urls[1], "prefill"))
        dec, pre = r.pool.workers
        flip = "/internal/workers/{}/flip"

        async def refused(name: str, role: object, status: int, code: str, says: str) -> None:
            got, error = await call(s, base, "POST", flip.format(name), {"role": role})
            assert (got, error["error"]["code"]) == (status, code), error
            assert says in error["error"]["message"]

        await refused("nobody", "decode", 404, "unknown_worker", "no worker named 'nobody'")
        await refused("dec", "decode", 409, "same_role", "worker dec already has role decode")
        await refused("dec", "both", 400, "invalid_role", "role must be one of")
        decode, prefill = r.dispatcher.queues["decode"], r.dispatcher.queues["prefill"]
        decode.hold(dec)  # a request in flight, the only decode-capable worker
        await refused("dec", "collocated", 409, "last_of_role",
                      "worker dec is the last decode-capable (decode or collocated) worker and "
                      "1 requests are queued or in flight")
        prefill.hold(pre)  # a split request's prefill in flight
        await refused("pre", "decode", 409, "last_of_role",
                      "worker pre is the last prefill worker and 1 split requests")
        prefill.take_back(pre)
        dec.phase = "draining"
        await refused("dec", "prefill", 409, "flip_in_progress", "worker dec is draining")
        dec.phase = None
        assert [(w.role, w.state) for w in r.pool.workers] == [("decode", "healthy"),
                                                               ("prefill", "healthy")]
        assert fakes[0].flips == fakes[1].flips == 0
        status, result = await call(s, base, "POST", flip.format("pre"), {"role": "decode"})
        assert status == 200 and (result["from"], result["to"]) == ("prefill", "decode")

    run(tiny_model, fakes, body)
