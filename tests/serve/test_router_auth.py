"""The router's front door through real processes and the official `openai` client: API keys
(401 AuthenticationError without the right one), a token bucket per key (429 RateLimitError
with Retry-After), /metrics behind its own key, /health public."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from pdserve.cluster.up_process import free_port, get_json
from tests.serve.test_mismatch import Processes, write_secret

KEY, SECOND_KEY = "sk-router-" + os.urandom(12).hex(), "sk-second-" + os.urandom(12).hex()
METRICS_KEY = "metrics-" + os.urandom(12).hex()


def _client(router: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router + "/v1", api_key=key, max_retries=0, timeout=60)


def _complete(client: openai.OpenAI, model: str) -> int:
    out = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.usage.completion_tokens


def _status(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def router(tmp_path: Path, tiny_model) -> tuple[str, str]:
    """A collocated worker behind a router with two keys (one from a file), a rate limit of
    one request per 100 s with a burst of 2 per key, and a metrics key: (router URL, model)."""
    procs = Processes(tmp_path, tiny_model())
    try:
        secret = write_secret(tmp_path / "secret")
        (tmp_path / "keys").write_text(f"# clients\n{SECOND_KEY}\n")
        (tmp_path / "metrics-key").write_text(METRICS_KEY + "\n")
        port = free_port((0, 1, 101))
        worker = procs.worker("collocated", "collocated", port + 1, secret)
        procs.start("router", "router", "--port", str(port), "--model", procs.model,
                    "--secret-file", str(secret), "--collocated", worker,
                    "--api-key", KEY, "--api-keys-file", str(tmp_path / "keys"),
                    "--rate-limit", "0.01", "--rate-burst", "2",
                    "--metrics-key-file", str(tmp_path / "metrics-key"))
        url = f"http://127.0.0.1:{port}"
        procs.wait_live("collocated", worker)
        procs.wait_live("router", url)
        yield url, procs.model
    finally:
        procs.stop()


def test_keys_and_the_rate_limit_with_the_openai_client(router: tuple[str, str]) -> None:
    url, model = router
    with pytest.raises(openai.AuthenticationError) as e:
        _complete(_client(url, "unused"), model)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "unused" not in str(e.value.message)
    status, body = _status(url + "/v1/models")  # no Authorization header at all
    assert status == 401 and body["error"]["message"].startswith("You didn't provide an API key")

    client = _client(url, KEY)
    assert _complete(client, model) == 3
    assert [m.id for m in client.models.list().data] == [model]
    with pytest.raises(openai.RateLimitError) as e:
        _complete(client, model)
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.type == "requests"
    retry_after = int(e.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 100  # one token per 100 s
    assert _complete(_client(url, SECOND_KEY), model) == 3  # its own bucket

    assert get_json(url + "/health") == {"status": "ok"}  # public, never limited
    assert _status(url + "/metrics")[0] == 401
    assert _status(url + "/metrics", {"Authorization": f"Bearer {KEY}"})[0] == 401
    with urllib.request.urlopen(urllib.request.Request(
            url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}),
            timeout=5) as r:
        scraped = r.read().decode()
    assert 'pdserve_router_responses_total{status="401"} 2' in scraped
    assert 'pdserve_router_responses_total{status="429"} 1' in scraped
