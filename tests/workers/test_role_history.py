"""A worker remembers its roles over time: the role it started in and each completed role change
(when, from, to, how long the flip took), bounded, and `GET /internal/steps?since=T` returns the
role in force at T and every change after it beside the steps, on a real worker (tiny model,
tcp transport, decode role: test_access.py's) served in this process and flipped over signed
HTTP."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pdserve.config import Role
from pdserve.workers import server
from pdserve.workers.role_history import RoleHistory, RoleSpan
from tests.workers.test_access import CLUSTER, _settings, running


def test_a_history_starts_with_the_role_the_worker_started_in() -> None:
    h = RoleHistory(Role.DECODE, 100.0)
    assert h.current == RoleSpan(Role.DECODE, 100.0, None, None)
    assert h.since(0.0) == h.since(500.0) == [h.current]
    assert h.current.to_json() == {"role": "decode", "since": 100.0, "from": None,
                                   "flip_seconds": None}


def test_since_gives_the_role_in_force_then_and_each_change_after() -> None:
    h = RoleHistory(Role.DECODE, 100.0)
    h.changed(Role.PREFILL, 110.0, 0.5)
    h.changed(Role.DECODE, 130.0, 2.0)
    start, to_prefill, back = h.since(0.0)
    assert to_prefill == RoleSpan(Role.PREFILL, 110.0, Role.DECODE, 0.5)
    assert back.to_json() == {"role": "decode", "since": 130.0, "from": "prefill",
                              "flip_seconds": 2.0}
    assert h.since(109.9) == [start, to_prefill, back]
    assert h.since(110.0) == h.since(120.0) == [to_prefill, back]
    assert h.since(131.0) == [back] == [h.current]


def test_a_full_history_drops_its_oldest_spans() -> None:
    h = RoleHistory(Role.COLLOCATED, 0.0, capacity=2)
    for i, role in enumerate((Role.PREFILL, Role.DECODE, Role.PREFILL)):
        h.changed(role, 10.0 * (i + 1), 0.1)
    assert [(s.from_role, s.role, s.since) for s in h.since(0.0)] == \
        [(Role.PREFILL, Role.DECODE, 20.0), (Role.DECODE, Role.PREFILL, 30.0)]
    with pytest.raises(ValueError, match="keeps at least 1 span, got capacity 0"):
        RoleHistory(Role.DECODE, 0.0, capacity=0)


@pytest.fixture(autouse=True)
def _no_heap_freeze(monkeypatch) -> None:
    monkeypatch.setattr(server, "freeze_startup_heap", lambda: None)  # not in a test process


async def _role(s: aiohttp.ClientSession, url: str, role: str) -> tuple[int, dict]:
    async with s.post(url + "/internal/role", json={"role": role},
                      headers=CLUSTER.headers("POST", "/internal/role")) as r:
        return r.status, await r.json()


async def _steps(s: aiohttp.ClientSession, url: str, since: float) -> dict:
    async with s.get(f"{url}/internal/steps?since={since!r}",
                     headers=CLUSTER.headers("GET", "/internal/steps")) as r:
        assert r.status == 200
        return await r.json()


def test_the_steps_endpoint_returns_the_roles_over_the_interval(tiny_model) -> None:
    async def go() -> None:
        async with running(_settings(tiny_model())) as url, aiohttp.ClientSession() as s:
            before = time.time()
            status, to_prefill = await _role(s, url, "prefill")
            assert status == 200, to_prefill
            between = time.time()
            status, refused = await _role(s, url, "prefill")
            assert status == 409 and refused["error"]["code"] == "same_role"
            status, to_decode = await _role(s, url, "decode")
            assert status == 200, to_decode
            after = time.time()

            trace = await _steps(s, url, 0.0)
            assert set(trace) >= {"role", "role_since", "fields", "steps"}  # as before
            started, flip1, flip2 = trace["roles"]
            assert started["role"] == "decode" and started["from"] is None
            assert started["flip_seconds"] is None and started["since"] <= before
            assert (flip1["from"], flip1["role"], flip1["flip_seconds"]) == \
                ("decode", "prefill", to_prefill["seconds"])
            assert (flip2["from"], flip2["role"], flip2["flip_seconds"]) == \
                ("prefill", "decode", to_decode["seconds"])
            assert before < flip1["since"] <= between < flip2["since"] <= after
            assert trace["role"] == "decode" and trace["role_since"] == flip2["since"]
            assert (await _steps(s, url, between))["roles"] == [flip1, flip2]
            assert (await _steps(s, url, after))["roles"] == [flip2]

    asyncio.run(go())
