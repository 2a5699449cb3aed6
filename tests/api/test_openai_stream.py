"""The OpenAI endpoints' streaming over a real aiohttp server and a scripted `generate`.

A generate function yields events one at a time or in batches (those that were ready
together): the client receives the same SSE bytes either way, in the same order, and a batch
costs one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.api import responses as R
from pdserve.api.openai_server import OpenAIServer
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import EventBatch, TokenEvent
from pdserve.testing.tiny_models import tiny_tokenizer
from tests.http_app import serving

MODEL = "tiny"
WORDS = ["Par", "is", " is", " the", " capital"]


def events(finish: str = "length") -> list[TokenEvent]:
    """One event per word, the last one final with `finish`."""
    out, offset = [], 0
    for i, word in enumerate(WORDS):
        last = i == len(WORDS) - 1
        out.append(TokenEvent(i, [100 + i], offset, word, finish_reason=finish if last else None,
                              prompt_tokens=3, final=last))
        offset += len(word)
    return out


Script = Sequence[TokenEvent | EventBatch]


def serve(script: Script) -> OpenAIServer:
    async def generate(request_id: str, prompt: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenEvent | EventBatch]:
        for item in script:
            await asyncio.sleep(0)
            yield item

    return OpenAIServer(MODEL, tiny_tokenizer(), lambda: 512, generate)


@contextlib.asynccontextmanager
async def running(server: OpenAIServer) -> AsyncIterator[str]:
    app = web.Application()
    server.add_routes(app)
    async with serving(app) as base:
        yield base + "/v1"


def post(script: Script, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """Status and body, with the random request id and the clock made constant."""

    async def go() -> tuple[int, bytes, str]:
        async with running(serve(script)) as url, aiohttp.ClientSession() as session, \
                session.post(url + path, json={"model": MODEL, **body}) as resp:
            return resp.status, await resp.read(), resp.headers.get("X-Request-Id", "")

    status, raw, request_id = asyncio.run(go())
    if request_id:
        raw = raw.replace(request_id.encode(), b"ID")
    return status, re.sub(rb'"created":\d+', b'"created":0', raw)


class Writes:
    """Every `StreamResponse.write` and `write_eof` the server makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.ended: list[web.StreamResponse] = []
        write, write_eof = web.StreamResponse.write, web.StreamResponse.write_eof

        async def counted_write(response: web.StreamResponse, data: bytes) -> None:
            self.calls.append(("write", bytes(data)))
            await write(response, data)

        async def counted_eof(response: web.StreamResponse, data: bytes = b"") -> None:
            if response not in self.ended:  # aiohttp calls it again after the handler
                self.ended.append(response)
                self.calls.append(("eof", bytes(data)))
            await write_eof(response, data)

        monkeypatch.setattr(web.StreamResponse, "write", counted_write)
        monkeypatch.setattr(web.StreamResponse, "write_eof", counted_eof)


def sse(body: bytes) -> list[bytes]:
    events = body.split(b"\n\n")
    assert events[-1] == b""
    return events[:-1]


COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
              "stream_options": {"include_usage": True}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}


@pytest.mark.parametrize(("path", "body"), [("/completions", COMPLETION),
                                            ("/chat/completions", CHAT)])
def test_batches_give_the_same_bytes_as_single_events(monkeypatch: pytest.MonkeyPatch,
                                                      path: str, body: dict[str, Any]) -> None:
    e = events()
    status, one_by_one = post(e, path, body)
    assert status == 200
    writes = Writes(monkeypatch)
    status, batched = post([[e[0]], e[1:4], [e[4]]], path, body)
    assert status == 200 and batched == one_by_one
    # token 0 alone (with the headers, and chat's role chunk), tokens 1-3 in one write, and
    # the last token with the usage chunk and [DONE] in the end of the response
    kinds = [kind for kind, _ in writes.calls]
    assert kinds == ["write", "write", "eof"]
    chunks = [len(sse(data)) for _, data in writes.calls]
    assert chunks == [2 if path == "/chat/completions" else 1, 3, 3 if "stream_options" in body
                      else 2]
    received = [json.loads(x[len(b"data: "):]) for x in sse(batched)[:-1]]
    texts = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content"))
             for c in received if c["choices"]]
    assert "".join(t or "" for t in texts) == "".join(WORDS)
    assert sse(batched)[-1] == R.SSE_DONE.rstrip(b"\n")


def test_an_error_in_a_batch_ends_the_stream_after_the_events_before_it() -> None:
    e = events()
    failed = TokenEvent(2, [], len("Paris"), "", error="the decode worker died", final=True)
    status, body = post([[e[0]], [e[1], failed, e[2]]], "/completions", COMPLETION)
    assert status == 200
    received = sse(body)
    assert [json.loads(x[6:])["choices"][0]["text"] for x in received[:2]] == ["Par", "is"]
    assert json.loads(received[2][6:])["error"]["message"] == "the decode worker died"
    assert received[3:] == [R.SSE_DONE.rstrip(b"\n")]


def test_an_error_before_any_token_is_a_plain_error_response() -> None:
    failed = TokenEvent(0, [], 0, "", error="no worker took it", final=True)
    status, body = post([[failed]], "/completions", COMPLETION)
    assert status == 500
    assert json.loads(body)["error"]["message"] == "no worker took it"


def test_a_collected_response_takes_batches() -> None:
    e = events("stop")
    status, body = post([e[:2], e[2:]], "/completions", {**COMPLETION, "stream": False,
                                                         "stream_options": None})
    assert status == 200
    choice = json.loads(body)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("".join(WORDS), "stop")
