"""A real `pdserve worker` process changes role over signed HTTP (`POST /internal/role`) without
restarting or reloading: the endpoint refuses strangers and bad bodies, the worker reports its
new role, serves in it, refuses new requests while a client's own stream holds a change to
prefill, and keeps its role when that drain outlasts the timeout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster.child import is_healthy
from pdserve.cluster.up_process import free_port
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth
from pdserve.workers.role_flip import FLIPPING
from tests.serve.cluster import metric

SECRET = os.urandom(32).hex().encode()
AUTH = InternalAuth(SECRET)
START_TIMEOUT_S = 120.0
PROMPT = list(range(3, 40))
FLIPS_TO_DECODE = 'pdserve_role_flips_total{from="collocated",to="decode"}'
STREAM_TOKENS = 300  # a stream that outlasts a flip's first moments by far


def _send(url: str, method: str = "GET", body: object = None,
          headers: dict[str, str] | None = None) -> tuple[int, bytes, dict]:
    data = None if body is None else \
        (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _call(url: str, method: str = "GET", body: object = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    status, raw, got = _send(url, method, body, headers)
    return status, json.loads(raw), got


def signed_post(url: str, path: str, body: object) -> tuple[int, dict]:
    """A signed POST to one of the worker's /internal/ paths; the answer's proof of the secret
    is checked."""
    headers = AUTH.headers("POST", path)
    status, raw, got = _send(url + path, "POST", body, headers)
    assert AUTH.check_proof(headers[AUTH_HEADER], raw, got.get(PROOF_HEADER)), raw
    return status, json.loads(raw)


def _role(url: str, body: object) -> tuple[int, dict]:
    return signed_post(url, "/internal/role", body)


def _health(url: str) -> dict:
    status, info, _ = _call(url + "/health", headers=AUTH.headers("GET", "/health"))
    assert status == 200
    return info


def _complete(url: str, max_tokens: int = 16) -> tuple[int, dict]:
    status, body, _ = _call(url + "/v1/completions", "POST", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    return status, body


class Stream:
    """A long streamed completion read on a thread; `running` is set at its first chunk."""

    def __init__(self, url: str) -> None:
        self.running, self.chunks = threading.Event(), 0
        self.text, self.finish_reason = "", None
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": STREAM_TOKENS,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        self._request = urllib.request.Request(url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json"})
        self._thread = threading.Thread(target=self._read)
        self._thread.start()
        assert self.running.wait(60)

    def _read(self) -> None:
        with urllib.request.urlopen(self._request, timeout=300) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                if not choices:
                    continue
                choice = choices[0]
                self.text += choice["text"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
                self.chunks += 1
                self.running.set()

    def join(self) -> None:
        self._thread.join(300)
        assert not self._thread.is_alive()


@contextlib.contextmanager
def serve_worker(model: Path, folder: Path, *args: str) -> Iterator[str]:
    """A collocated `pdserve worker` process that serves /v1 itself and holds the cluster
    secret (written into `folder`), with `args` added; its URL once ready."""
    secret = folder / "cluster-secret"
    secret.write_bytes(SECRET)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "worker", "--model", str(model),
         "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port),
         "--secret-file", str(secret), "--serve-public", "--max-model-len", "1024",
         "--kv-cache-memory", "16MiB", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not is_healthy(url + "/health", auth=AUTH):
            assert proc.poll() is None and time.monotonic() < deadline, "never ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory) -> Iterator[str]:
    with serve_worker(tiny_model(), tmp_path_factory.mktemp("secret")) as url:
        yield url


def test_only_the_cluster_may_change_the_role(worker: str) -> None:
    status, body, _ = _call(worker + "/internal/role", "POST", {"role": "decode"})
    assert status == 401 and body["error"]["code"] == "invalid_internal_auth"
    wrong_path = AUTH.headers("POST", "/internal/steps")
    status, body, _ = _call(worker + "/internal/role", "POST", {"role": "decode"}, wrong_path)
    assert status == 401
    assert _health(worker)["role"] == "collocated"
    assert _role(worker, {"role": "decode"})[0] == 200  # the same body, signed for its path
    assert _role(worker, {"role": "collocated"})[0] == 200


@pytest.mark.parametrize("body, param, says", [
    ({"role": "router"}, "role", "role must be one of collocated, prefill, decode"),
    ({}, "role", "role must be one of"),
    ({"role": "decode", "timeout_s": 0}, "timeout_s", "timeout_s must be a number"),
    ({"role": "decode", "timeout": 5}, "timeout", "unknown key(s) ['timeout']"),
    (["decode"], None, "the body must be a JSON object"),
    (b"role=decode", None, "the body is not JSON"),
])
def test_a_bad_body_is_400_naming_what_is_wrong(worker: str, body: object, param: str | None,
                                                says: str) -> None:
    status, answer = _role(worker, body)
    assert status == 400 and answer["error"]["param"] == param
    assert says in answer["error"]["message"]
    assert _health(worker)["role"] == "collocated"


def test_the_role_it_has_already_is_a_conflict(worker: str) -> None:
    status, answer = _role(worker, {"role": "collocated"})
    assert status == 409
    assert answer["error"] == {"message": "this worker is collocated already",
                               "type": "invalid_request_error", "param": "role",
                               "code": "same_role"}


def test_a_worker_becomes_decode_and_collocated_again_and_serves(worker: str) -> None:
    flips = metric(worker, FLIPS_TO_DECODE)
    before = _complete(worker)
    assert before[0] == 200
    status, answer = _role(worker, {"role": "decode", "reason": "the decode pool is short"})
    assert status == 200 and set(answer) == {"from", "to", "seconds"}
    assert (answer["from"], answer["to"]) == ("collocated", "decode") and answer["seconds"] > 0
    info = _health(worker)
    assert (info["role"], info["state"]) == ("decode", "serving") and info["peer"]
    assert _complete(worker)[1]["choices"] == before[1]["choices"]  # local prefill in decode
    status, answer = _role(worker, {"role": "collocated", "timeout_s": 10})
    assert status == 200 and (answer["from"], answer["to"]) == ("decode", "collocated")
    assert _health(worker)["role"] == "collocated"
    after = _complete(worker)
    assert after[0] == 200 and after[1]["choices"] == before[1]["choices"]
    assert metric(worker, FLIPS_TO_DECODE) == flips + 1
    assert metric(worker, 'pdserve_worker_role{role="collocated"}') == 1
    assert metric(worker, 'pdserve_worker_role{role="decode"}') == 0


def test_requests_during_a_flip_are_refused_with_503_until_it_ends(worker: str) -> None:
    stream = Stream(worker)
    flip: list[tuple[int, dict]] = []
    flipper = threading.Thread(target=lambda: flip.append(_role(worker, {"role": "prefill",
                                                                         "timeout_s": 600})))
    flipper.start()
    deadline = time.monotonic() + 30
    while _health(worker)["state"] != "flipping":
        assert time.monotonic() < deadline and not flip, flip
    status, body = _complete(worker)
    assert status == 503 and body["error"]["message"].startswith(FLIPPING)
    stream.join()
    flipper.join(300)
    assert flip[0][0] == 200 and flip[0][1]["to"] == "prefill"
    assert stream.finish_reason == "length"  # the running stream ended whole
    assert _role(worker, {"role": "collocated"})[0] == 200


def test_a_drain_past_its_timeout_keeps_the_role(worker: str) -> None:
    stream = Stream(worker)
    status, answer = _role(worker, {"role": "prefill", "timeout_s": 0.05})
    assert status == 503 and answer["error"]["code"] == "drain_timeout"
    info = _health(worker)
    assert (info["role"], info["state"]) == ("collocated", "serving")
    assert _complete(worker)[0] == 200  # takes requests again at once
    stream.join()
    assert stream.finish_reason == "length"
