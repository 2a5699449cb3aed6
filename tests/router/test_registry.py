"""Workers joining and leaving the router's pool (`router/registry.py`) against real HTTP
servers: a join is accepted only once the worker's own signed /health proves the secret and
agrees with the cluster and with what it registered; every refusal leaves the pool as it was."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from pdserve.api.errors import ApiError
from pdserve.internal_auth import InternalAuth
from pdserve.router.registry import JoinRequest, WorkerRegistry
from pdserve.router.worker_pool import WorkerPool
from tests.router.fake_worker import NAME, SECRET, FakeWorker, fake_workers, worker_info


def _join(name: str, url: str, role: str = "decode", kv: str | None = None) -> JoinRequest:
    return JoinRequest.from_json({"name": name, "url": url, "role": role, "kv_endpoint": kv})


def _run(fakes: list[FakeWorker], static: int,
         body: Callable[[WorkerPool, WorkerRegistry, list[str]], Awaitable[None]]) -> None:
    """`body(pool, registry, urls)` with the first `static` fakes on the command line."""
    async def go() -> None:
        async with fake_workers(*fakes) as urls, aiohttp.ClientSession() as session:
            pool = WorkerPool({"decode": urls[:static]}, InternalAuth(SECRET), NAME)
            await pool.refresh(session)
            await body(pool, WorkerRegistry(pool, lambda: session), urls)

    asyncio.run(go())


async def _refused(join: Awaitable[object], status: int, code: str, message: str) -> None:
    with pytest.raises(ApiError) as e:
        await join
    assert (e.value.status, e.value.code) == (status, code)
    assert message in e.value.message, e.value.message


def test_a_worker_joins_an_empty_pool_and_fixes_the_reference() -> None:
    async def body(pool: WorkerPool, registry: WorkerRegistry, urls: list[str]) -> None:
        assert pool.reference is None
        worker, new = await registry.join(_join("w1", urls[0] + "/"))
        assert new and pool.workers == [worker] and pool.healthy("decode") == [worker]
        assert (worker.key, worker.url, worker.registered) == ("w1", urls[0], True)
        assert pool.reference is not None and pool.reference["max_model_len"] == 512
        again, new = await registry.join(_join("w1", urls[0]))  # a restart: rejoins in place
        assert again is worker and not new and pool.workers == [worker]

    _run([FakeWorker(worker_info())], 0, body)


def test_duplicates_are_refused_and_change_nothing() -> None:
    async def body(pool: WorkerPool, registry: WorkerRegistry, urls: list[str]) -> None:
        static = pool.workers[0]
        await registry.join(_join("w1", urls[1]))
        before = list(pool.workers)
        await _refused(registry.join(_join("w1", urls[2])), 409, "duplicate_worker",
                       f"a worker named w1 is already in the pool, at {urls[1]}")
        await _refused(registry.join(_join(static.key, urls[2])), 409, "duplicate_worker",
                       f"a worker named {static.key} is already in the pool")
        await _refused(registry.join(_join("w2", urls[1])), 409, "duplicate_worker",
                       f"{urls[1]} is already in the pool as worker w1")
        await _refused(registry.join(_join("w2", urls[0])), 409, "duplicate_worker",
                       f"{urls[0]} is already in the pool as worker {static.key}")
        assert pool.workers == before

    _run([FakeWorker(worker_info()) for _ in range(3)], 1, body)


def test_an_incompatible_or_unproved_worker_is_refused_with_the_reason() -> None:
    fakes = [FakeWorker(worker_info()), FakeWorker(worker_info(max_model_len=256)),
             FakeWorker(worker_info(kv_layout=dict(worker_info()["kv_layout"], block_size=32))),
             FakeWorker(worker_info(), secret=b"o" * 32), FakeWorker(worker_info(), prove=False),
             FakeWorker(worker_info("prefill")),
             FakeWorker(worker_info(peer={"instance_id": "00000000000000ab",
                                          "host": "127.0.0.1", "port": 9}))]

    async def body(pool: WorkerPool, registry: WorkerRegistry, urls: list[str]) -> None:
        cases = [
            (_join("len", urls[1]), "max_model_len 256 differs from the cluster's 512"),
            (_join("block", urls[2]), "kv_layout.block_size 32 differs from the cluster's 16"),
            (_join("secret", urls[3]), f"the server at {urls[3]} does not share the cluster "
                                       "secret (it answered 401"),
            (_join("proof", urls[4]), "does not share the cluster secret (its answer carries "
                                      "no valid proof"),
            (_join("role", urls[5]), "it registered as decode but its /health says 'prefill'"),
            (_join("kv", urls[6]), "it registered KV endpoint None but its /health reports "
                                   "'127.0.0.1:9'"),
        ]
        for req, reason in cases:
            await _refused(registry.join(req), 422, "incompatible_worker", reason)
        assert [w.key for w in pool.workers] == [pool.workers[0].key]
        await _refused(registry.join(_join("gone", "http://127.0.0.1:9")), 502,
                       "worker_unreachable", "health check of http://127.0.0.1:9")
        worker, _ = await registry.join(_join("kv", urls[6], kv="127.0.0.1:9"))
        assert worker.routable and worker.peer is not None and worker.peer.port == 9

    _run(fakes, 1, body)


@pytest.mark.parametrize("body", [
    [], {"name": "", "url": "http://a:1", "role": "decode"},
    {"name": "a/b", "url": "http://a:1", "role": "decode"},
    {"name": "w", "url": "http://a:1/v1", "role": "decode"},
    {"name": "w", "url": "ftp://a:1", "role": "decode"},
    {"name": "w", "url": "http://a:1", "role": "both"},
    {"name": "w", "url": "http://a:1", "role": "decode", "kv_endpoint": 9},
])
def test_a_malformed_join_is_a_400(body: object) -> None:
    with pytest.raises(ApiError) as e:
        JoinRequest.from_json(body)
    assert (e.value.status, e.value.code) == (400, "invalid_worker")


def test_heartbeats_drain_and_leave_only_registered_workers() -> None:
    async def body(pool: WorkerPool, registry: WorkerRegistry, urls: list[str]) -> None:
        static = pool.workers[0]
        worker, _ = await registry.join(_join("w1", urls[1]))
        assert registry.beat("w1", "draining") is worker
        assert worker.state == "draining" and pool.healthy("decode") == [static]
        registry.beat("w1", None)
        assert worker.state == "healthy" and worker in pool.healthy("decode")
        for call, status, code in ((lambda: registry.beat("w1", "resting"), 400,
                                    "invalid_worker"),
                                   (lambda: registry.beat(static.key, "serving"), 403,
                                    "static_worker"),
                                   (lambda: registry.leave(static.key), 403, "static_worker"),
                                   (lambda: registry.leave("w9"), 404, "unknown_worker")):
            with pytest.raises(ApiError) as e:
                call()
            assert (e.value.status, e.value.code) == (status, code)
        removed: list[str] = []
        pool.on_removed.append(lambda w, why: removed.append(why))
        assert registry.leave("w1") is worker
        assert pool.workers == [static] and removed == ["deregistered"]

    _run([FakeWorker(worker_info()) for _ in range(2)], 1, body)


def test_a_registered_worker_follows_the_role_it_reports_and_a_static_one_does_not() -> None:
    fakes = [FakeWorker(worker_info()), FakeWorker(worker_info())]

    async def body(pool: WorkerPool, registry: WorkerRegistry, urls: list[str]) -> None:
        static = pool.workers[0]
        joined, _ = await registry.join(_join("w1", urls[1]))
        for fake in fakes:  # each flipped by a call to the worker itself
            fake.info = dict(fake.info, role="prefill")
        async with aiohttp.ClientSession() as session:
            await pool.refresh(session)
        assert (static.role, joined.role) == ("decode", "prefill")
        assert pool.healthy("prefill") == [joined]

    _run(fakes, 1, body)
