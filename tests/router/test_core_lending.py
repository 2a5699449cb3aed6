"""Cores lent between two workers of one machine (`router/core_lending.py`), on a real router
whose workers are fake HTTP servers that keep the worker's `POST /internal/cpus` contract (the
cores they are pinned to show in their signed /health). Proves: a lend drains the prefill
worker (LENT: never routable) and pins the borrower once to both workers' cores; a reclaim
pins it back and the lender serves again; every refusal (unknown worker, bad body, wrong
roles, other machine, no cores, not routable, the last prefill worker while a split request
waits for it, a borrower that refuses or never answers the pin, a drain past its timeout)
answers its status and code and changes nothing; flips of either side are refused while they
lend or borrow; and faults end a loan: a restarted borrower, a lender that left or drains,
a borrower that is pinned back only once it answers again; a worker found on cores not its
own through no loan of the router (one that restarted) is pinned back to its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.bench.compare import counter_samples
from pdserve.internal_auth import AUTH_HEADER, InternalAuth
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.app import Router
from pdserve.router.worker_pool import WorkerHandle
from tests.http_app import serving
from tests.router.fake_worker import worker_info
from tests.router.test_registry_admin import FlippingWorker, call, card, router

HOST = "node-1/boot-a"
SILENT = None  # a pin answer: the fake never answers within the router's timeout
WAIT_S = 5.0  # the longest a test waits for the router's background work (health rounds: 1 s)


class PinningWorker(FlippingWorker):
    """A fake worker whose /health reports `cpus`, `own_cpus` (those it was started on: `cpus`
    unless `own` says) and `host`, and whose signed `POST /internal/cpus` records the cores
    asked (`pins`) and, answering `pin_answer` 200, reports them from then on; any other status
    refuses them (nothing changes), SILENT sleeps past the router's timeout."""

    def __init__(self, role: str, cpus: list[int] | None, host: str | None = HOST,
                 pin_answer: int | None = 200, own: list[int] | None = None) -> None:
        info = worker_info(role)
        if cpus is not None:
            info["cpus"] = cpus
            info["own_cpus"] = own or cpus
        if host is not None:
            info["host"] = host
        super().__init__(info)
        self.pin_answer = pin_answer
        self.pins: list[list[int]] = []
        self.on_pin: Callable[[], Awaitable[None]] | None = None  # run before it answers

    async def cpus(self, request: web.Request) -> web.Response:
        if (refused := self.unsigned(request)) is not None:
            return refused
        header = request.headers[AUTH_HEADER]
        cpus = (await request.json())["cpus"]
        self.pins.append(cpus)
        if self.on_pin is not None:
            await self.on_pin()
        if self.pin_answer is SILENT:
            await asyncio.sleep(30)
        if self.pin_answer != 200:
            return self.answered(header, {"error": {"message": "a tensor-parallel engine keeps "
                                                               "its cores"}}, self.pin_answer)
        if self.prove_changes:
            self.info = dict(self.info, cpus=sorted(cpus))
        return self.answered(header, {"cpus": sorted(cpus), "threads": len(cpus),
                                      "seconds": 0.001})


def app_of(fake: PinningWorker) -> web.Application:
    app = web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_post("/internal/role", fake.role)
    app.router.add_post("/internal/cpus", fake.cpus)
    return app


@dataclass
class Cluster:
    """A router whose pool is the fakes, each joined under its name."""

    r: Router
    base: str
    session: aiohttp.ClientSession
    fakes: dict[str, PinningWorker]
    urls: dict[str, str]

    def w(self, name: str) -> WorkerHandle:
        worker = self.r.pool.find(name)
        assert worker is not None, name
        return worker

    async def post(self, path: str, body: object = None) -> tuple[int, Any]:
        return await call(self.session, self.base, "POST", path, body)

    async def lend(self, name: str, to: object) -> tuple[int, Any]:
        return await self.post(f"/internal/workers/{name}/lend", {"to": to})

    async def reclaim(self, name: str) -> tuple[int, Any]:
        return await self.post(f"/internal/workers/{name}/reclaim")

    async def beat(self, name: str, state: str) -> tuple[int, Any]:
        """The worker's heartbeat (draining: it is about to leave)."""
        return await call(self.session, self.base, "PUT", f"/internal/workers/{name}",
                          {"state": state})

    async def leave(self, name: str) -> tuple[int, Any]:
        return await call(self.session, self.base, "DELETE", f"/internal/workers/{name}")

    async def flip(self, name: str, role: str) -> tuple[int, Any]:
        return await self.post(f"/internal/workers/{name}/flip", {"role": role})

    async def borrows_nothing(self, borrower: str = "dec") -> None:
        """No loan stands and `borrower` may flip again (to collocated: it serves)."""
        assert self.r.admin.lending.loans == {}
        assert not self.r.admin.lending.borrows(self.w(borrower))
        assert (await self.flip(borrower, "collocated"))[0] == 200

    async def listing(self) -> dict[str, dict[str, Any]]:
        status, workers = await call(self.session, self.base, "GET", "/internal/workers")
        assert status == 200
        return {w["name"]: w for w in workers}

    async def round(self) -> None:
        """One health round now (as the router's watcher runs each second)."""
        await self.r.pool.refresh(self.r._session())

    def snapshot(self) -> tuple[object, ...]:
        """Everything a refused lend or reclaim must leave as it was."""
        return ([(w.key, w.role, w.state, w.info.get("cpus")) for w in self.r.pool.workers],
                {name: list(f.pins) for name, f in self.fakes.items()},
                {name: f.flips for name, f in self.fakes.items()},
                dict(self.r.admin.lending.loans))


@contextlib.asynccontextmanager
async def cluster(tiny_model: Callable[..., Path], fakes: dict[str, PinningWorker],
                  **settings: Any) -> AsyncIterator[Cluster]:
    async with contextlib.AsyncExitStack() as stack:
        urls = {name: await stack.enter_async_context(serving(app_of(fake)))
                for name, fake in fakes.items()}
        r, base = await stack.enter_async_context(router(tiny_model(), **settings))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for name, fake in fakes.items():
            status, joined = await call(session, base, "POST", "/internal/workers",
                                        card(name, urls[name], fake.info["role"]))
            assert (status, joined["state"]) == (201, "healthy"), joined
        yield Cluster(r, base, session, fakes, urls)


def run(tiny_model: Callable[..., Path], fakes: dict[str, PinningWorker],
        body: Callable[[Cluster], Awaitable[None]], **settings: Any) -> None:
    async def go() -> None:
        async with cluster(tiny_model, fakes, **settings) as c:
            await body(c)

    asyncio.run(go())


async def until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def loan_counts(c: Cluster) -> dict[str, int]:
    """`pdserve_core_loans_total` by event, from the router's metrics (zeros left out)."""
    c.r.metrics.refresh()
    samples = counter_samples(c.r.metrics.registry.render(), "pdserve_core_loans_total")
    return {labels["event"]: n for labels, n in samples if n}


def pair() -> dict[str, PinningWorker]:
    return {"pre": PinningWorker("prefill", [0]), "dec": PinningWorker("decode", [1])}


def assert_error(got: tuple[int, Any], status: int, code: str | None, says: str = "") -> None:
    assert (got[0], got[1]["error"]["code"]) == (status, code), got
    assert says in got[1]["error"]["message"], got


def test_a_lend_pins_the_borrower_to_both_and_a_reclaim_gives_them_back(
        tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        status, lent = await c.lend("pre", "dec")
        assert status == 200, lent
        assert set(lent) == {"worker", "to", "cpus", "seconds"}
        assert (lent["worker"], lent["to"], lent["cpus"]) == ("pre", "dec", [0, 1])
        assert isinstance(lent["seconds"], float) and lent["seconds"] >= 0
        assert fakes["dec"].pins == [[0, 1]] and fakes["pre"].pins == []
        listed = await c.listing()
        assert (listed["pre"]["state"], listed["pre"]["lent_to"], listed["pre"]["cpus"]) == (
            "lent", "dec", [0])
        assert (listed["dec"]["state"], listed["dec"]["lent_to"], listed["dec"]["cpus"]) == (
            "healthy", None, [0, 1])
        assert c.r.pool.healthy("prefill") == []
        assert c.r.pool.healthy("decode") == [c.w("dec")]
        await c.round()  # the borrower's /health now says [0, 1]: the loan stands
        assert c.w("pre").state == "lent" and c.w("dec").info["cpus"] == [0, 1]
        assert_error(await c.lend("pre", "dec"), 409, "not_routable", "worker pre is lent")

        status, back = await c.reclaim("pre")
        assert status == 200, back
        assert set(back) == {"worker", "from", "cpus", "pinned_back", "seconds"}
        assert (back["worker"], back["from"], back["cpus"], back["pinned_back"]) == (
            "pre", "dec", [0], True)
        assert fakes["dec"].pins == [[0, 1], [1]]
        assert c.r.pool.healthy("prefill") == [c.w("pre")]
        listed = await c.listing()
        assert (listed["pre"]["state"], listed["pre"]["lent_to"]) == ("healthy", None)
        assert listed["dec"]["cpus"] == [1]
        assert c.r.admin.lending.loans == {}
        before = c.snapshot()
        assert_error(await c.reclaim("pre"), 409, "not_lent", "worker pre has lent no cores")
        assert_error(await c.reclaim("dec"), 409, "not_lent")
        assert loan_counts(c) == {"lent": 1, "reclaimed": 1}
        assert c.snapshot() == before

    run(tiny_model, fakes, body)


def test_two_lenders_one_borrower_each_reclaim_keeps_the_others_cores(
        tiny_model: Callable[..., Path]) -> None:
    fakes = {"pre": PinningWorker("prefill", [0]), "pre2": PinningWorker("prefill", [2, 3]),
             "col": PinningWorker("collocated", [1])}

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre", "col"))[1]["cpus"] == [0, 1]
        await c.round()
        assert (await c.lend("pre2", "col"))[1]["cpus"] == [0, 1, 2, 3]
        status, back = await c.reclaim("pre")
        assert (status, back["cpus"], back["pinned_back"]) == (200, [0], True)
        assert fakes["col"].pins == [[0, 1], [0, 1, 2, 3], [1, 2, 3]]
        assert c.w("pre").routable and c.w("pre2").state == "lent"
        assert (await c.reclaim("pre2"))[1]["cpus"] == [2, 3]
        assert fakes["col"].pins[-1] == [1]
        assert c.r.pool.healthy("prefill") == [c.w("pre"), c.w("pre2")]

    run(tiny_model, fakes, body)


def test_refused_lends_change_nothing(tiny_model: Callable[..., Path]) -> None:
    fakes = {**pair(), "pre2": PinningWorker("prefill", [2]),
             "far": PinningWorker("decode", [3], host="node-2/boot-b"),
             "nohost": PinningWorker("decode", [4], host=None),
             "nocpus": PinningWorker("decode", None),
             "nocpus_pre": PinningWorker("prefill", None)}

    async def body(c: Cluster) -> None:
        before = c.snapshot()
        for path, payload in (("lend", {"to": "dec"}), ("reclaim", None)):
            for auth in (None, InternalAuth(b"x" * 32)):
                got = await call(c.session, c.base, "POST", f"/internal/workers/pre/{path}",
                                 payload, auth)
                assert_error(got, 401, "invalid_internal_auth")
        assert_error(await c.lend("nobody", "dec"), 404, "unknown_worker",
                     "no worker named 'nobody'")
        assert_error(await c.lend("pre", "nobody"), 404, "unknown_worker",
                     "no worker named 'nobody'")
        assert_error(await c.reclaim("nobody"), 404, "unknown_worker")
        assert_error(await c.lend("pre", "pre"), 400, "invalid_loan",
                     "worker pre cannot lend its cores to itself")
        for bad, param, says in (({"to": 3}, "to", 'like {"to": "WORKER"}'),
                                 ({}, "to", 'like {"to": "WORKER"}'),
                                 (["dec"], "to", 'like {"to": "WORKER"}'),
                                 (b"{", None, "the body must be JSON"),
                                 (b"", None, "the body must be JSON")):
            status, error = await c.post("/internal/workers/pre/lend", bad)
            assert (status, error["error"]["param"]) == (400, param), (bad, error)
            assert says in error["error"]["message"], (bad, error)
        assert_error(await c.lend("dec", "pre"), 409, "not_prefill",
                     "worker dec is a decode worker")
        assert_error(await c.lend("pre", "pre2"), 409, "not_decode_capable",
                     "worker pre2 is a prefill worker")
        assert_error(await c.lend("pre", "far"), 409, "other_host",
                     "(hosts 'node-1/boot-a' and 'node-2/boot-b')")
        assert_error(await c.lend("pre", "nohost"), 409, "other_host",
                     "(hosts 'node-1/boot-a' and None)")
        assert_error(await c.lend("pre", "nocpus"), 409, "no_cpus",
                     "worker nocpus reports no cores")
        assert_error(await c.lend("nocpus_pre", "dec"), 409, "no_cpus",
                     "worker nocpus_pre reports no cores")
        assert c.snapshot() == before
        for name, other in (("dec", "pre"), ("pre", "dec")):
            assert (await c.beat(name, "draining"))[0] == 200
            assert_error(await c.lend("pre", "dec"), 409, "not_routable",
                         f"worker {name} is draining")
            assert c.w(name).phase == "draining" and c.w(other).phase is None
            assert (await c.beat(name, "serving"))[0] == 200
        assert c.snapshot() == before
        assert c.r.admin.lending.loans == {} and all(not f.pins for f in fakes.values())

    run(tiny_model, fakes, body)


def test_the_last_prefill_worker_is_not_lent_while_a_split_request_waits_for_it(
        tiny_model: Callable[..., Path]) -> None:
    async def body(c: Cluster) -> None:
        pre, queue = c.w("pre"), c.r.dispatcher.queues["prefill"]
        queue.hold(pre)  # its only slot is taken: the next split request waits
        waiter = asyncio.ensure_future(queue.acquire(lambda free: free[0], 40))
        await until("a request waits for a prefill slot", lambda: queue.depth == 1)
        before = c.snapshot()
        assert_error(await c.lend("pre", "dec"), 409, "last_of_role",
                     "worker pre is the last prefill worker and 1 split requests wait for a "
                     "prefill slot")
        assert c.snapshot() == before and c.r.pool.healthy("prefill") == [pre]
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        queue.take_back(pre)
        assert queue.depth == 0 and queue.held(pre) == 0
        status, lent = await c.lend("pre", "dec")  # the last one, and nobody waits: it may
        assert (status, lent["cpus"]) == (200, [0, 1])

    run(tiny_model, pair(), body,
        admission=AdmissionSettings(max_inflight_per_worker=1))


@pytest.mark.parametrize(("answer", "status", "says"), [
    (409, 409, "worker dec refused cores [0, 1] (409): a tensor-parallel engine keeps its"),
    (400, 400, "worker dec refused cores [0, 1] (400): "),
    (500, 502, "worker dec refused cores [0, 1] (500): "),
    (SILENT, 504, "worker dec did not answer within 0.5 s when pinned to cores [0, 1]"),
])
def test_a_pin_the_borrower_refuses_ends_the_lend_and_the_lender_serves_again(
        tiny_model: Callable[..., Path], answer: int | None, status: int, says: str) -> None:
    fakes = {"pre": PinningWorker("prefill", [0]),
             "dec": PinningWorker("decode", [1], pin_answer=answer)}

    async def body(c: Cluster) -> None:
        assert_error(await c.lend("pre", "dec"), status, "lend_failed", says)
        assert fakes["dec"].pins == [[0, 1]]
        assert c.r.pool.healthy("prefill") == [c.w("pre")]
        assert c.w("dec").info["cpus"] == [1] and c.r.admin.lending.loans == {}
        listed = await c.listing()
        assert (listed["pre"]["state"], listed["pre"]["lent_to"]) == ("healthy", None)
        await c.borrows_nothing()

    run(tiny_model, fakes, body, flip_timeout_s=0.5)


def test_an_answer_without_proof_of_the_secret_is_no_answer(
        tiny_model: Callable[..., Path]) -> None:
    """Whoever answers the pin or the flip without the worker's proof may not speak for it:
    the lend fails as if the worker were unreachable, and so does a flip (its role stays)."""
    fakes = pair()
    fakes["dec"].prove_changes = False

    async def body(c: Cluster) -> None:
        assert_error(await c.lend("pre", "dec"), 502, "lend_failed",
                     "worker dec answered 200 without proof of the cluster secret when pinned "
                     "to cores [0, 1]")
        assert c.r.pool.healthy("prefill") == [c.w("pre")] and c.r.admin.lending.loans == {}
        assert c.w("dec").info["cpus"] == [1]
        status, error = await c.flip("dec", "collocated")
        assert (status, error["error"]["code"]) == (502, "flip_failed"), error
        assert "answered 200 without proof of the cluster secret" in error["error"]["message"]
        assert c.w("dec").role == "decode"

    run(tiny_model, fakes, body)


def test_a_lend_waits_for_the_lenders_legs_to_end(tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        pre, queue = c.w("pre"), c.r.dispatcher.queues["prefill"]
        queue.hold(pre)  # a split request's prefill in flight on it
        pre.inflight = 1
        lend = asyncio.ensure_future(c.lend("pre", "dec"))
        await until("the lender is lent", lambda: pre.phase == "lent")
        assert c.r.pool.healthy("prefill") == []  # no new work while it drains
        await asyncio.sleep(0.3)
        assert not lend.done() and fakes["dec"].pins == []
        listed = await c.listing()
        assert (listed["pre"]["state"], listed["pre"]["lent_to"]) == ("lent", None)
        queue.take_back(pre)
        await asyncio.sleep(0.2)
        assert not lend.done() and fakes["dec"].pins == []  # its leg is still open
        pre.inflight = 0
        status, lent = await asyncio.wait_for(lend, WAIT_S)
        assert (status, lent["cpus"]) == (200, [0, 1]) and lent["seconds"] >= 0.5
        assert fakes["dec"].pins == [[0, 1]]
        assert (await c.listing())["pre"]["lent_to"] == "dec"

    run(tiny_model, fakes, body)


def test_a_drain_past_the_timeout_fails_the_lend_and_the_lender_serves_again(
        tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        pre, queue = c.w("pre"), c.r.dispatcher.queues["prefill"]
        queue.hold(pre)  # never released
        assert_error(await c.lend("pre", "dec"), 503, "lend_failed",
                     "worker pre still held 1 legs after 0.3 s: its cores were not lent")
        assert c.r.pool.healthy("prefill") == [pre] and pre.phase is None
        assert fakes["dec"].pins == [] and c.r.admin.lending.loans == {}
        assert (await c.listing())["pre"]["lent_to"] is None

    run(tiny_model, fakes, body, flip_timeout_s=0.3)


def test_a_lender_that_starts_draining_during_the_lend_stays_draining(
        tiny_model: Callable[..., Path]) -> None:
    """A lender whose own heartbeat says draining (it is shutting down) during the lend's
    drain ends the lend at once, and is not made routable again."""
    fakes = pair()

    async def body(c: Cluster) -> None:
        pre, queue = c.w("pre"), c.r.dispatcher.queues["prefill"]
        queue.hold(pre)
        lend = asyncio.ensure_future(c.lend("pre", "dec"))
        await until("the lender is lent", lambda: pre.phase == "lent")
        assert (await c.beat("pre", "draining"))[0] == 200  # it is shutting down
        got = await asyncio.wait_for(lend, WAIT_S)
        assert got == (409, {"error": {"message": "worker pre is draining now: no cores were "
                                                  "lent", "type": "invalid_request_error",
                                       "param": None, "code": "lend_failed"}}), got
        assert pre.phase == "draining" and c.r.pool.healthy("prefill") == []
        assert fakes["dec"].pins == []

    run(tiny_model, fakes, body, flip_timeout_s=WAIT_S * 2)


def test_a_lender_that_leaves_while_it_drains_lends_nothing(
        tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        pre, queue = c.w("pre"), c.r.dispatcher.queues["prefill"]
        queue.hold(pre)
        lend = asyncio.ensure_future(c.lend("pre", "dec"))
        await until("the lender is lent", lambda: pre.phase == "lent")
        assert (await c.leave("pre"))[0] == 200
        queue.take_back(pre)  # its last leg ended
        assert_error(await asyncio.wait_for(lend, WAIT_S), 409, "lend_failed",
                     "worker pre left the pool")
        assert fakes["dec"].pins == []
        await c.borrows_nothing()

    run(tiny_model, fakes, body)


def test_a_lender_that_leaves_while_the_borrower_is_pinned_gets_it_pinned_back(
        tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        async def leave() -> None:
            fakes["dec"].on_pin = None
            assert (await c.leave("pre"))[0] == 200

        fakes["dec"].on_pin = leave
        assert_error(await c.lend("pre", "dec"), 409, "lend_failed",
                     "worker pre left the pool while worker dec was pinned")
        await until("the borrower is pinned back", lambda: len(fakes["dec"].pins) == 2)
        assert fakes["dec"].pins == [[0, 1], [1]]
        await c.borrows_nothing()

    run(tiny_model, fakes, body)


def test_flips_of_a_lender_and_of_its_borrower_are_refused(
        tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre", "dec"))[0] == 200
        before = c.snapshot()
        assert_error(await c.flip("pre", "decode"), 409, "lent",
                     "worker pre has lent its cores: reclaim them first")
        assert_error(await c.flip("dec", "collocated"), 409, "borrowing",
                     "worker dec computes on cores lent to it: reclaim them first")
        assert c.snapshot() == before
        assert fakes["pre"].flips == fakes["dec"].flips == 0
        assert (await c.reclaim("pre"))[0] == 200
        assert (await c.flip("dec", "collocated"))[0] == 200
        assert (await c.flip("pre", "decode"))[0] == 200
        assert fakes["pre"].flips == fakes["dec"].flips == 1

    run(tiny_model, fakes, body)


def test_a_borrower_that_restarted_ends_the_loan(tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre", "dec"))[0] == 200
        await c.round()  # the same process: the loan stands
        assert c.w("pre").state == "lent"
        fakes["dec"].info = dict(fakes["dec"].info, pid=5151, cpus=[1])  # a new process
        await c.round()
        assert c.r.admin.lending.loans == {}
        assert c.r.pool.healthy("prefill") == [c.w("pre")]
        listed = await c.listing()
        assert (listed["pre"]["state"], listed["pre"]["lent_to"]) == ("healthy", None)
        assert listed["dec"]["cpus"] == [1]
        assert fakes["dec"].pins == [[0, 1]]  # it is on its own cores: nothing to pin back
        assert_error(await c.reclaim("pre"), 409, "not_lent")
        assert loan_counts(c) == {"lent": 1, "ended": 1}

    run(tiny_model, fakes, body)


@pytest.mark.parametrize("how", ["leaves", "drains"])
def test_a_lender_that_leaves_or_drains_gets_the_borrower_pinned_back(
        tiny_model: Callable[..., Path], how: str) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre", "dec"))[0] == 200
        left = await (c.leave("pre") if how == "leaves" else c.beat("pre", "draining"))
        assert left[0] == 200
        await until("the borrower is pinned back", lambda: fakes["dec"].info["cpus"] == [1])
        await asyncio.sleep(0.1)
        assert fakes["dec"].pins == [[0, 1], [1]]
        assert c.r.admin.lending.loans == {} and not c.r.admin.lending.borrows(c.w("dec"))
        listed = await c.listing()
        assert listed["dec"]["cpus"] == [1]
        if how == "leaves":
            assert "pre" not in listed
        else:
            assert (listed["pre"]["state"], listed["pre"]["lent_to"]) == ("draining", None)
        assert c.r.pool.healthy("prefill") == []

    run(tiny_model, fakes, body)


def test_a_borrower_that_leaves_ends_the_loan(tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre", "dec"))[0] == 200
        assert (await c.leave("dec"))[0] == 200
        assert c.r.admin.lending.loans == {}
        assert c.r.pool.healthy("prefill") == [c.w("pre")]
        assert fakes["dec"].pins == [[0, 1]]

    run(tiny_model, fakes, body)


def test_a_borrower_that_does_not_answer_the_reclaim_is_pinned_back_when_it_does(
        tiny_model: Callable[..., Path]) -> None:
    fakes = pair()

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre", "dec"))[0] == 200
        fakes["dec"].pin_answer = 503
        status, back = await c.reclaim("pre")
        assert status == 200, back
        assert (back["from"], back["cpus"], back["pinned_back"]) == ("dec", [0], False)
        assert fakes["dec"].pins == [[0, 1], [1]] and fakes["dec"].info["cpus"] == [0, 1]
        assert c.r.pool.healthy("prefill") == [c.w("pre")]
        assert c.r.admin.lending.loans == {}
        assert_error(await c.reclaim("pre"), 409, "not_lent")
        await c.round()  # it answers /health, still on [0, 1]: the pin back is tried again
        await until("a second try", lambda: len(fakes["dec"].pins) >= 3)
        assert fakes["dec"].info["cpus"] == [0, 1]
        fakes["dec"].pin_answer = 200
        await until("pinned back", lambda: fakes["dec"].info["cpus"] == [1])
        assert fakes["dec"].pins[-1] == [1]
        await c.round()
        assert c.w("dec").info["cpus"] == [1] and c.r.admin.lending._repin == {}
        tries = len(fakes["dec"].pins)
        await c.round()
        assert len(fakes["dec"].pins) == tries  # done: no more pins

    run(tiny_model, fakes, body)


def test_a_borrower_of_a_loan_the_router_does_not_know_is_pinned_back(
        tiny_model: Callable[..., Path]) -> None:
    """As after a router restart while a loan stood: the decode worker computes on cores 0-1,
    its own is 1, and this router lent it nothing. Pinned back at its first /health (joined),
    once; then nothing more."""
    fakes = {"pre": PinningWorker("prefill", [0]),
             "dec": PinningWorker("decode", [0, 1], own=[1])}

    async def body(c: Cluster) -> None:
        await until("pinned back", lambda: fakes["dec"].pins == [[1]])
        await until("reported", lambda: c.w("dec").info["cpus"] == [1])
        for _ in range(2):
            await c.round()
        assert fakes["dec"].pins == [[1]] and fakes["pre"].pins == []
        assert c.r.admin.lending.loans == {} and c.w("pre").routable
        status, lent = await c.lend("pre", "dec")  # and a loan of its own stands
        assert (status, lent["cpus"]) == (200, [0, 1]), lent
        for _ in range(2):
            await c.round()
        assert fakes["dec"].pins == [[1], [0, 1]]

    run(tiny_model, fakes, body)


@pytest.mark.parametrize("then", ["lend", "reclaim"])
def test_a_pin_back_under_way_never_undoes_a_later_loan_or_reclaim(
        tiny_model: Callable[..., Path], then: str) -> None:
    """dec borrows from pre1 and pre2; pre1 leaves, so dec is pinned back to its own core and
    pre2's in the background, slowly. Meanwhile pre2's cores are reclaimed, or (pre2 lending
    nothing yet) pre2 lends them: the last pin dec gets is that change's (its own core, or its
    own and pre2's), never the stale pin back, and the loan records its own core as dec's."""
    fakes = {"pre1": PinningWorker("prefill", [0]), "pre2": PinningWorker("prefill", [2]),
             "dec": PinningWorker("decode", [1])}

    async def body(c: Cluster) -> None:
        assert (await c.lend("pre1", "dec"))[0] == 200
        if then == "reclaim":
            assert (await c.lend("pre2", "dec"))[0] == 200
        slow = asyncio.Event()

        async def stall() -> None:  # the pin back answers only once the change was asked
            fakes["dec"].on_pin = None
            await slow.wait()

        fakes["dec"].on_pin = stall
        assert (await c.leave("pre1"))[0] == 200
        await until("the pin back reached dec", lambda: fakes["dec"].on_pin is None)
        change = asyncio.ensure_future(c.reclaim("pre2") if then == "reclaim"
                                       else c.lend("pre2", "dec"))
        await asyncio.sleep(0.2)
        slow.set()
        assert (await change)[0] == 200
        for _ in range(2):
            await c.round()
        await asyncio.sleep(0.2)
        final = [1] if then == "reclaim" else [1, 2]
        before = [[0, 1], [0, 1, 2], [1, 2]] if then == "reclaim" else [[0, 1], [1]]
        assert fakes["dec"].pins == [*before, final]  # one pin each, in order
        assert fakes["dec"].info["cpus"] == final
        if then == "lend":
            loan = c.r.admin.lending.loans["pre2"]
            assert loan.borrower_cpus == (1,) and loan.lender_cpus == (2,)
        else:
            assert c.r.admin.lending.loans == {}

    run(tiny_model, fakes, body)
