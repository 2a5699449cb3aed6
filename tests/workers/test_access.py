"""Who may use a worker's endpoints, against a real worker (tiny model, decode role, tcp
transport) served in this process: the leg channel and the engine steps need a request signed
with the cluster secret, once; `/health` tells anyone only whether it is alive, and a signed
request everything, with the worker's proof of the secret; `/v1` needs `--serve-public`;
`/metrics` needs its key when it has one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig, Role
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth
from pdserve.legs.frames import open_frame, parse_replies
from pdserve.legs.protocol import LegRequest, TokenEvent
from pdserve.workers import server
from pdserve.workers.server import Worker
from pdserve.workers.settings import WorkerSettings
from tests.http_app import serving

SECRET = b"s" * 32
CLUSTER = InternalAuth(SECRET)
STRANGER = InternalAuth(b"x" * 32)
METRICS_KEY = "m" * 24


def _settings(model: Path, **kw) -> WorkerSettings:
    role = kw.pop("role", Role.DECODE)
    engine = EngineConfig(model=str(model), dtype="float32", max_model_len=256, role=role,
                          num_kv_blocks=64)
    kw.setdefault("secret", SECRET)
    return WorkerSettings(role=role, engine=engine, served_model_name="tiny", **kw)


@contextlib.asynccontextmanager
async def running(settings: WorkerSettings, load: bool = True) -> AsyncIterator[str]:
    """The worker's HTTP app at a free port (its model loaded unless `load` is False)."""
    worker = Worker(settings)
    if load:
        worker.load(asyncio.get_running_loop())
    try:
        async with serving(worker.app()) as url:
            yield url
    finally:
        worker.close()


@pytest.fixture(autouse=True)
def _no_heap_freeze(monkeypatch) -> None:
    monkeypatch.setattr(server, "freeze_startup_heap", lambda: None)  # not in a test process


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        return r.status, await r.json(), dict(r.headers)


def _error(body: dict) -> tuple[str, str]:
    return body["error"]["code"], body["error"]["message"]


def test_the_leg_channel_needs_a_fresh_signature_for_its_path(tiny_model) -> None:
    async def go() -> None:
        async with running(_settings(tiny_model())) as url, aiohttp.ClientSession() as s:
            legs = url + "/internal/legs"
            for headers, why in ((dict, "no X-Pdserve-Auth header"),
                                 (lambda: STRANGER.headers("GET", "/internal/legs"),
                                  "signature does not match"),
                                 (lambda: {AUTH_HEADER: "zz"}, "not hex"),
                                 (lambda: CLUSTER.headers("GET", "/internal/steps"),
                                  "signed for another request")):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await s.ws_connect(legs, headers=headers())
                assert refused.value.status == 401
                status, body, _ = await _get(legs, headers())
                assert status == 401 and _error(body)[0] == "invalid_internal_auth"
                assert body["error"]["type"] == "invalid_request_error"
                assert why in _error(body)[1]
            good = CLUSTER.headers("GET", "/internal/legs")
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            async with s.ws_connect(legs, headers=good) as ws:
                await ws.send_bytes(open_frame(1, LegRequest("r1", (3, 4, 5), params)))
                events = []
                while not (events and events[-1].final):
                    msg = await asyncio.wait_for(ws.receive(), 30)
                    events += [TokenEvent.from_line(line) for _, status, body in
                               parse_replies(msg.data) for line in body.splitlines()]
                assert sum(len(e.token_ids) for e in events) == 4
            with pytest.raises(aiohttp.WSServerHandshakeError) as replayed:
                await s.ws_connect(legs, headers=good)
            assert replayed.value.status == 401

    asyncio.run(go())


def test_engine_steps_need_the_secret(tiny_model) -> None:
    async def go() -> None:
        async with running(_settings(tiny_model())) as url:
            steps = url + "/internal/steps?since=0"
            status, body, _ = await _get(steps)
            assert status == 401 and "no X-Pdserve-Auth header" in _error(body)[1]
            status, body, _ = await _get(steps, STRANGER.headers("GET", "/internal/steps"))
            assert status == 401 and "signature does not match" in _error(body)[1]
            header = CLUSTER.headers("GET", "/internal/steps")
            status, body, _ = await _get(steps, header)
            assert status == 200 and body["role"] == "decode" and "steps" in body
            status, body, _ = await _get(steps, header)
            assert status == 401 and "replayed" in _error(body)[1]

    asyncio.run(go())


def test_health_tells_strangers_liveness_and_the_cluster_everything(tiny_model) -> None:
    async def go() -> None:
        async with running(_settings(tiny_model())) as url:
            status, body, _ = await _get(url + "/health")
            assert (status, body) == (200, {"status": "ok"})
            header = CLUSTER.headers("GET", "/health")
            async with aiohttp.ClientSession() as s, s.get(url + "/health",
                                                           headers=header) as r:
                raw, proof = await r.read(), r.headers.get(PROOF_HEADER)
                info = await r.json()
            assert r.status == 200 and CLUSTER.check_proof(header[AUTH_HEADER], raw, proof)
            assert not STRANGER.check_proof(header[AUTH_HEADER], raw, proof)
            assert info["pid"] > 0 and info["peer"]["port"] > 0 and info["role"] == "decode"
            assert info["dtype"] == "float32" and info["kv_blocks_total"] == 64
            assert info["kv_layout"]["block_size"] == 16 == info["block_size"]
            assert info["kv_layout"]["dtype"] == "float32"
            assert info["kv_layout"]["model_id"] == "tiny"
            for bad in (STRANGER.headers("GET", "/health"), header,  # header: a replay
                        CLUSTER.headers("GET", "/internal/steps")):
                status, body, headers = await _get(url + "/health", bad)
                assert status == 401 and _error(body)[0] == "invalid_internal_auth"
                assert PROOF_HEADER not in headers

    asyncio.run(go())


def test_a_loading_worker_refuses_unsigned_internal_requests_before_saying_it_loads(
        tiny_model) -> None:
    async def go() -> None:
        async with running(_settings(tiny_model()), load=False) as url:
            status, body, _ = await _get(url + "/health")
            assert (status, body) == (503, {"status": "loading"})
            status, body, _ = await _get(url + "/internal/steps")
            assert status == 401
            header = CLUSTER.headers("GET", "/health")
            status, body, headers = await _get(url + "/health", header)
            assert (status, body) == (503, {"status": "loading"}) and PROOF_HEADER in headers

    asyncio.run(go())


def test_v1_needs_serve_public(tiny_model) -> None:
    request = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2}

    async def post(url: str) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                        json=request) as r:
            return r.status, await r.json()

    async def go() -> None:
        async with running(_settings(tiny_model())) as url:
            status, body = await post(url)
            assert status == 403 and _error(body)[0] == "worker_not_public"
            assert "through the router" in _error(body)[1]
            assert "--serve-public" in _error(body)[1]
            status, body, _ = await _get(url + "/v1/models")
            assert status == 403
        async with running(_settings(tiny_model(), serve_public=True)) as url:
            status, body = await post(url)
            assert status == 200 and body["usage"]["completion_tokens"] == 2

    asyncio.run(go())


def test_a_public_collocated_worker_without_a_secret_has_no_internal_endpoints(
        tiny_model) -> None:
    async def go() -> None:
        settings = _settings(tiny_model(), role=Role.COLLOCATED, secret=None, serve_public=True)
        async with running(settings) as url:
            for path in ("/internal/steps", "/internal/legs"):
                status, body, _ = await _get(url + path, CLUSTER.headers("GET", path))
                assert status == 403 and _error(body)[0] == "no_cluster_secret"
                assert "no cluster secret" in _error(body)[1]
            status, body, _ = await _get(url + "/health", CLUSTER.headers("GET", "/health"))
            assert status == 403
            status, body, _ = await _get(url + "/health")
            assert (status, body) == (200, {"status": "ok"})

    asyncio.run(go())


def test_metrics_need_the_key_when_there_is_one(tiny_model) -> None:
    async def scrape(url: str, headers: dict[str, str]) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics", headers=headers) as r:
            return r.status, await r.text()

    async def go() -> None:
        async with running(_settings(tiny_model())) as url:
            status, text = await scrape(url, {})
            assert status == 200 and "pdserve_kv_blocks_used" in text
        async with running(_settings(tiny_model(), metrics_keys=(METRICS_KEY,))) as url:
            for headers in ({}, {"Authorization": "Bearer " + "n" * 24},
                            {"Authorization": METRICS_KEY}):
                status, text = await scrape(url, headers)
                assert status == 401 and "invalid_api_key" in text
            status, text = await scrape(url, {"Authorization": f"Bearer {METRICS_KEY}"})
            assert status == 200 and "pdserve_kv_blocks_used" in text

    asyncio.run(go())


def test_a_flood_of_refusals_logs_one_warning_with_the_address(tiny_model, caplog) -> None:
    async def go() -> None:
        async with running(_settings(tiny_model()), load=False) as url, \
                aiohttp.ClientSession() as s:
            for _ in range(20):
                async with s.get(url + "/internal/steps") as r:
                    assert r.status == 401

    with caplog.at_level(logging.WARNING, logger="pdserve.worker"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1
    assert "GET /internal/steps from 127.0.0.1" in lines[0] and "X-Pdserve-Auth" in lines[0]
