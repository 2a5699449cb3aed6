"""A worker's side of joining a router (`workers/register.py`): the `--register` options it
refuses before loading anything, and the registration task against a real router (the worker
a fake HTTP server): it joins, joins again when the router forgot it, and leaves by draining
then deregistering."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from pdserve.internal_auth import InternalAuth
from pdserve.workers.register import JoinSettings, Registration
from pdserve.workers.settings import (
    WorkerLaunch,
    add_worker_args,
    launch_from_args,
    settings_from_args,
    worker_argv,
)
from tests.router.fake_worker import SECRET, worker_info
from tests.router.test_registry_admin import FlippingWorker, call, router, workers
from tests.workers.test_settings import _settings


def test_register_names_the_worker_by_its_address_unless_named(tmp_path: Path) -> None:
    s = _settings(tmp_path, "--port", "9001", "--register", "http://10.0.0.1:8000/")
    assert s.join == JoinSettings(router="http://10.0.0.1:8000", name="127.0.0.1:9001",
                                  url="http://127.0.0.1:9001")
    s = _settings(tmp_path, "--host", "10.0.0.2", "--register", "http://r:8000", "--name",
                  "gpu-3", "--drain-timeout", "5")
    assert (s.join.name, s.join.url, s.join.drain_timeout_s) == ("gpu-3", "http://10.0.0.2:8001",
                                                                 5.0)
    assert _settings(tmp_path).join is None


@pytest.mark.parametrize(("argv", "match"), [
    (["--register", "r:8000"], "--register must be http://HOST:PORT"),
    (["--register", "http://r:8000", "--name", "a b"], "a worker name is 1-64"),
    (["--name", "w"], "--name names this worker in the pool it joins: give --register"),
    (["--register", "http://r:8000", "--host", "0.0.0.0"], "give the one the router can reach"),
    (["--register", "http://r:8000", "--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
])
def test_bad_register_options_say_what_to_fix(tmp_path: Path, argv: list[str],
                                               match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _settings(tmp_path, *argv)


def test_register_needs_the_cluster_secret() -> None:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    args = p.parse_args(["--serve-public", "--register", "http://r:8000"])
    with pytest.raises(ValueError, match="--register needs the cluster secret"):
        settings_from_args(args)


def test_the_register_options_read_back_from_the_argv() -> None:
    launch = WorkerLaunch(register="http://r:8000", name="w-1", drain_timeout_s=4.5)
    p = argparse.ArgumentParser()
    add_worker_args(p)
    assert launch_from_args(p.parse_args(worker_argv(launch))) == launch


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def test_it_joins_rejoins_when_forgotten_and_leaves_after_draining(
        tiny_model: Callable[..., Path]) -> None:
    fake = FlippingWorker(worker_info("collocated", legs=1))

    async def go() -> None:
        async with workers(fake) as (url,), router(tiny_model()) as (r, base), \
                aiohttp.ClientSession() as session:
            join = JoinSettings(router=base, name="w1", url=url, drain_timeout_s=30,
                                heartbeat_s=0.02, retry_s=0.02)
            registration = Registration(join, InternalAuth(SECRET), lambda: fake.info)
            registration.start()
            await _until(lambda: [w.key for w in r.pool.healthy("collocated")] == ["w1"],
                         "joined")
            assert (await call(session, base, "DELETE", "/internal/workers/w1"))[0] == 200
            await _until(lambda: [w.key for w in r.pool.workers] == ["w1"], "joined again")
            leaving = asyncio.create_task(registration.leave())
            await _until(lambda: r.pool.workers[0].state == "draining", "draining")
            await asyncio.sleep(0.3)
            assert not leaving.done()  # a leg is still open on it
            fake.info = dict(fake.info, legs=0)
            await asyncio.wait_for(leaving, 10)
            assert r.pool.workers == []
            registrations = r.pool_metrics.registrations
            assert registrations.value(result="accepted") == 2

    asyncio.run(go())
