"""A real `pdserve worker` process as a stranger on loopback meets it: its internal endpoints
refuse unsigned requests, its `/v1` refuses clients (they go through the router), its `/health`
tells only liveness; the cluster's signed request gets the details and the worker's proof. And
a bad secret file stops a worker before it loads anything."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pdserve.cluster.up_process import free_port
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth

SECRET = os.urandom(32).hex().encode()
START_TIMEOUT_S = 120.0


def _worker(*argv: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "worker", *argv]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    secret = tmp_path_factory.mktemp("secret") / "cluster-secret"
    secret.write_bytes(SECRET)
    port = free_port()
    proc = subprocess.Popen(
        _worker("--model", str(tiny_model()), "--dtype", "float32", "--port", str(port),
                "--secret-file", str(secret), "--max-model-len", "256",
                "--kv-cache-memory", "16MiB"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the worker exited with {proc.returncode}"
            try:
                if _get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


def _error(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_a_stranger_gets_refusals_and_liveness_only(worker) -> None:
    url, _ = worker
    status, body, _ = _get(url + "/v1/models")
    assert status == 403 and _error(body)["code"] == "worker_not_public"
    assert "through the router" in _error(body)["message"]
    assert "--serve-public" in _error(body)["message"]
    status, body, _ = _get(url + "/internal/steps?since=0")
    assert status == 401 and _error(body)["code"] == "invalid_internal_auth"
    assert (_get(url + "/health")[0], json.loads(_get(url + "/health")[1])) == \
        (200, {"status": "ok"})

    async def upgrade(headers: dict[str, str]) -> int:
        async with aiohttp.ClientSession() as s:
            try:
                async with s.ws_connect(url + "/internal/legs", headers=headers):
                    return 101
            except aiohttp.WSServerHandshakeError as e:
                return e.status

    assert asyncio.run(upgrade({})) == 401
    other = InternalAuth(b"another cluster's secret").headers("GET", "/internal/legs")
    assert asyncio.run(upgrade(other)) == 401


def test_the_cluster_gets_details_with_the_workers_proof(worker) -> None:
    url, proc = worker
    auth = InternalAuth(SECRET)
    header = auth.headers("GET", "/health")
    status, body, headers = _get(url + "/health", header)
    assert status == 200
    assert auth.check_proof(header[AUTH_HEADER], body, headers.get(PROOF_HEADER))
    info = json.loads(body)
    assert info["pid"] == proc.pid and info["role"] == "collocated"
    assert info["dtype"] == "float32" and info["kv_layout"]["dtype"] == "float32"
    assert _get(url + "/health", header)[0] == 401  # the same header again: a replay
    steps = auth.headers("GET", "/internal/steps")
    status, body, _ = _get(url + "/internal/steps?since=0", steps)
    assert status == 200 and json.loads(body)["role"] == "collocated"


@pytest.mark.parametrize("secret, reason", [
    (b"0123456789abcde", "at least 16 bytes"),
    (None, "cannot read --secret-file"),
])
def test_a_bad_secret_file_stops_the_worker_before_it_loads(tmp_path: Path, secret: bytes | None,
                                                            reason: str) -> None:
    path = tmp_path / "secret"
    if secret is not None:
        path.write_bytes(secret)
    missing_model = tmp_path / "no-such-model"  # loading it would fail with another message
    out = subprocess.run(_worker("--model", str(missing_model), "--port", str(free_port()),
                                 "--secret-file", str(path)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert reason in out.stderr and str(path) in out.stderr
    assert "no-such-model" not in out.stderr and "listening" not in out.stderr
