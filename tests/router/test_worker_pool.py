"""The router's health checks against real HTTP servers: every check is signed and the answer
must prove the cluster secret; the first worker accepted fixes the cluster's reference and a
worker that differs from it is refused with the field and both values, logged once per change,
never routable, and accepted once it answers with matching details."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from pdserve.internal_auth import InternalAuth
from pdserve.router.worker_pool import DRAINING, FLIPPING, WorkerHandle, WorkerPool
from tests.router.fake_worker import NAME, SECRET, FakeWorker, fake_workers, worker_info
from tests.router.test_rate_limit import Clock


def _pool(urls: dict[str, list[str]]) -> WorkerPool:
    return WorkerPool(urls, InternalAuth(SECRET), NAME)


def _state(pool: WorkerPool) -> list[tuple[bool, str | None]]:
    return [(w.healthy, w.refused) for w in pool.workers]


def test_workers_that_do_not_prove_the_secret_are_refused() -> None:
    workers = [FakeWorker(worker_info()), FakeWorker(worker_info(), secret=b"x" * 32),
               FakeWorker(worker_info(), prove=False), FakeWorker(worker_info(), secret=None)]

    async def go() -> None:
        async with fake_workers(*workers) as urls, aiohttp.ClientSession() as session:
            pool = _pool({"decode": urls})
            await pool.refresh(session)
            assert _state(pool) == [
                (True, None),
                (False, "does not share the cluster secret (it answered 401 to the router's "
                        "signed request)"),
                (False, "does not share the cluster secret (its answer carries no valid proof "
                        "of it)"),
                (False, "does not share the cluster secret (it answered 403 to the router's "
                        "signed request)")]
            assert pool.healthy("decode") == [pool.workers[0]]
            assert workers[0].signed_checks == 1

    asyncio.run(go())


def test_the_first_worker_in_command_line_order_fixes_the_reference() -> None:
    long, short = (FakeWorker(worker_info(max_model_len=n)) for n in (512, 256))
    refusal = {512: "max_model_len 512 differs from the cluster's 256",
               256: "max_model_len 256 differs from the cluster's 512"}

    async def go() -> None:
        async with fake_workers(long, short) as (long_url, short_url), \
                aiohttp.ClientSession() as session:
            for first, second, n in ((long_url, short_url, 256), (short_url, long_url, 512)):
                pool = _pool({"prefill": [first], "decode": [second]})
                await pool.refresh(session)
                (ok, none), (bad, reason) = _state(pool)
                assert ok and none is None and not bad
                assert reason is not None and reason.startswith(refusal[n])
                assert pool.model_info is not None
                assert pool.model_info["max_model_len"] == 768 - n
                assert pool.healthy("decode") == []

    asyncio.run(go())


def test_a_refused_worker_stays_refused_logged_once_until_it_matches(
        caplog: pytest.LogCaptureFixture) -> None:
    reference = FakeWorker(worker_info("prefill"))
    other = FakeWorker(worker_info(dtype="bfloat16"))

    async def go() -> None:
        async with fake_workers(reference, other) as urls, aiohttp.ClientSession() as session:
            pool = _pool({"prefill": urls[:1], "decode": urls[1:]})
            with caplog.at_level(logging.INFO, logger="pdserve.router"):
                for _ in range(3):
                    await pool.refresh(session)
                    assert pool.healthy("decode") == []
                assert pool.workers[1].refused.startswith(
                    "dtype 'bfloat16' differs from the cluster's 'float32'")
                other.info = worker_info(kv_layout=dict(worker_info()["kv_layout"],
                                                        block_size=32))
                for _ in range(2):
                    await pool.refresh(session)
                assert pool.workers[1].refused.startswith(
                    "kv_layout.block_size 32 differs from the cluster's 16")
                other.info = worker_info(pid=4343)  # restarted with the cluster's settings
                await pool.refresh(session)
                assert pool.healthy("decode") == [pool.workers[1]]
                assert pool.workers[1].refused is None
            refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()
                        and r.levelno == logging.WARNING]
            assert len(refusals) == 2, refusals
            assert "dtype 'bfloat16'" in refusals[0] and "block_size 32" in refusals[1]
            assert any("restarted" in r.getMessage() and "pid 4343" in r.getMessage()
                       for r in caplog.records)

    asyncio.run(go())


def test_a_worker_that_serves_another_model_name_never_becomes_the_reference() -> None:
    async def go() -> None:
        async with fake_workers(FakeWorker(worker_info(model="other", max_model_len=128)),
                                FakeWorker(worker_info())) as urls, \
                aiohttp.ClientSession() as session:
            pool = _pool({"decode": urls})
            await pool.refresh(session)
            assert _state(pool) == [
                (False, "served model name 'other' differs from the router's 'tiny'"),
                (True, None)]
            assert pool.model_info is not None and pool.model_info["max_model_len"] == 512

    asyncio.run(go())


def test_a_pool_may_start_empty_and_keys_name_static_workers_by_host_and_port() -> None:
    assert _pool({}).workers == []
    pool = _pool({"decode": ["http://127.0.0.1:8002/", "http://127.0.0.1:8002"]})
    assert [w.key for w in pool.workers] == ["127.0.0.1:8002", "127.0.0.1:8002-2"]
    assert all(not w.registered for w in pool.workers)


def test_an_unheard_registered_worker_is_removed_after_the_grace_and_a_static_one_never() -> None:
    async def go() -> None:
        async with fake_workers(FakeWorker(worker_info()), FakeWorker(worker_info())) as urls, \
                aiohttp.ClientSession() as session:
            clock = Clock()
            pool = WorkerPool({"decode": urls[:1]}, InternalAuth(SECRET), NAME, grace_s=10.0,
                              clock=clock)
            removed: list[tuple[str, str]] = []
            pool.on_removed.append(lambda w, why: removed.append((w.key, why)))
            joined = WorkerHandle(urls[1], "decode", key="w1", registered=True)
            pool.add(joined)
            await pool.refresh(session)
            assert pool.healthy("decode") == pool.workers
            clock.now += 60  # both answer every round: heard, kept
            await pool.refresh(session)
            assert [w.key for w in pool.workers] == [pool.workers[0].key, "w1"]
        # both servers gone: 10 s unheard is the grace, a moment more removes the joined one
        async with aiohttp.ClientSession() as session:
            clock.now += 10.0
            await pool.refresh(session)
            assert len(pool.workers) == 2 and removed == []
            clock.now += 0.5
            await pool.refresh(session)
            assert [w.url for w in pool.workers] == urls[:1]  # static: unhealthy, never removed
            assert not pool.workers[0].healthy and removed == [("w1", "unheard")]
            clock.now += 3600
            await pool.refresh(session)
            assert [w.url for w in pool.workers] == urls[:1]

    asyncio.run(go())


def test_a_worker_in_a_phase_gets_no_work_of_any_role() -> None:
    pool = _pool({"decode": ["http://a:1", "http://b:1"]})
    a, b = pool.workers
    a.healthy = b.healthy = True
    a.phase = FLIPPING
    assert pool.healthy("decode") == [b]
    assert (a.state, b.state) == ("flipping", "healthy")
    b.phase = DRAINING
    assert pool.healthy("decode") == [] and b.state == "draining"
    b.phase, b.healthy = None, False
    assert b.state == "unhealthy"
