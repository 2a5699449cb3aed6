"""Every kind of bad input gets OpenAI's error JSON with a 4xx, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.serve.cluster import Cluster
from tests.serve.test_serving import client, prompts


def post(cluster: Cluster, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(cluster.url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


BAD = [
    ("/completions", b"{not json", 400, None),
    ("/completions", b"[1, 2]", 400, None),
    ("/completions", _body(prompt="hi", max_tokens=4), 400, "model"),
    ("/completions", _body(model="MODEL", max_tokens=4), 400, "prompt"),
    ("/completions", _body(model="MODEL", prompt="hi", max_tokens="4"), 400, "max_tokens"),
    ("/completions", _body(model="MODEL", prompt="hi", max_tokens=-1), 400, "max_tokens"),
    ("/completions", _body(model="MODEL", prompt="hi", max_tokens=10**9), 400, "max_tokens"),
    ("/completions", _body(model="MODEL", prompt="hi", temperature=-1), 400, "temperature"),
    ("/completions", _body(model="MODEL", prompt="hi", top_p=7), 400, "top_p"),
    ("/completions", _body(model="MODEL", prompt=[1, "x"]), 400, "prompt"),
    ("/completions", _body(model="MODEL", prompt=[[1], [2]]), 400, "prompt"),
    ("/completions", _body(model="MODEL", prompt=[1] * 600, max_tokens=1), 400, "prompt"),
    ("/completions", _body(model="MODEL", prompt=[10**7]), 400, None),
    ("/completions", _body(model="MODEL", prompt="hi", n=3), 400, "n"),
    ("/completions", _body(model="another-model", prompt="hi"), 404, "model"),
    ("/chat/completions", _body(model="MODEL"), 400, "messages"),
    ("/chat/completions", _body(model="MODEL", messages=[{"role": "wizard", "content": "x"}]),
     400, "messages"),
    ("/chat/completions", _body(model="MODEL", messages="hello"), 400, "messages"),
    ("/chat/completions", _body(model="MODEL", messages=[{"role": "user", "content": "x"}],
                                stream=False, stream_options={"include_usage": True}),
     400, "stream_options"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD,
                         ids=[f"{i}-{p[0].strip('/')}" for i, p in enumerate(BAD)])
def test_bad_input_gets_a_4xx_and_the_next_request_is_served(
        disagg_tcp: Cluster, path: str, body: bytes, status: int, param: str | None) -> None:
    body = body.replace(b'"MODEL"', json.dumps(disagg_tcp.model).encode())
    got, payload = post(disagg_tcp, path, body)
    assert got == status, payload
    error = payload["error"]
    assert error["message"] and isinstance(error["message"], str)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    ok = client(disagg_tcp).completions.create(model=disagg_tcp.model, prompt=prompts()[2],
                                               max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_the_official_client_raises_its_typed_errors(disagg_tcp: Cluster) -> None:
    c = client(disagg_tcp)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=disagg_tcp.model, prompt="hi", max_tokens=100_000)
    assert "maximum context length is 512 tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    disagg_tcp.wait_blocks_free([0, 1])
