"""Hostile requests against the OpenAI endpoints on a real aiohttp server (`start_site`, as the
router and the workers start theirs), with a scripted `generate`: every refusal is OpenAI's
error JSON, deadlines close connections, and long work leaves the event loop free."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.api import prepare
from pdserve.api.http_site import start_site
from pdserve.api.limits import DEFAULT_LIMITS, RequestLimits
from pdserve.api.openai_server import OpenAIServer
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import EventBatch, TokenEvent
from pdserve.testing.tiny_models import tiny_tokenizer

MODEL = "tiny"
MAX_LEN = 4096
SAFETY_S = 30.0  # only keeps a broken test from hanging; never what a test measures


class Served:
    """A server whose `generate` answers one token and records the prompts it got."""

    def __init__(self, limits: RequestLimits) -> None:
        self.prompts: list[list[int]] = []
        self.api = OpenAIServer(MODEL, tiny_tokenizer(), lambda: MAX_LEN, self._generate,
                                limits=limits)

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams
                        ) -> AsyncIterator[TokenEvent | EventBatch]:
        self.prompts.append(prompt)
        yield TokenEvent(0, [100], 0, "Paris", finish_reason="length",
                         prompt_tokens=len(prompt), final=True)


@contextlib.asynccontextmanager
async def running(limits: RequestLimits = DEFAULT_LIMITS) -> AsyncIterator[tuple[Served, int]]:
    served = Served(limits)
    app = web.Application()
    served.api.add_routes(app)
    runner = await start_site(app, "127.0.0.1", 0)
    try:
        yield served, runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def post(port: int, path: str, body: bytes | Any, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{port}/v1{path}", data=body, headers=headers or {
                "Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


async def raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), SAFETY_S)


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1, **fields}).encode()


def error_of(response: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


# ---- the body: size, Expect, deadline ---------------------------------------------------------


def test_a_declared_body_over_the_limit_is_a_413_json() -> None:
    async def go() -> None:
        async with running(RequestLimits(max_body_bytes=1000)) as (served, port):
            status, body = await post(port, "/completions", completion(prompt="x" * 2000))
            assert status == 413
            assert body["error"]["code"] == "request_too_large"
            assert "limit of 1000 bytes (--max-body-size)" in body["error"]["message"]
            assert served.prompts == []
            status, body = await post(port, "/completions", completion())  # still serving
            assert status == 200

    asyncio.run(go())


def test_a_chunked_body_over_the_limit_is_a_413_json() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 500

    async def go() -> None:
        async with running(RequestLimits(max_body_bytes=1000)) as (served, port):
            status, body = await post(port, "/completions", chunks())
            assert status == 413 and body["error"]["code"] == "request_too_large"
            assert served.prompts == []

    asyncio.run(go())


def test_expect_continue_with_a_huge_length_is_a_413_and_no_continue() -> None:
    async def go() -> None:
        async with running() as (_, port):
            reader, writer = await raw(port, (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000000000\r\nExpect: 100-continue\r\n\r\n"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
            assert head.startswith(b"HTTP/1.1 413 ")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            error = json.loads(await reader.readexactly(length))["error"]
            assert error["code"] == "request_too_large" and "--max-body-size" in error["message"]
            writer.close()

    asyncio.run(go())


def test_expect_continue_within_the_limit_is_continued_and_served() -> None:
    async def go() -> None:
        async with running() as (served, port):
            body = completion()
            reader, writer = await raw(port, (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body)))
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
            assert head.startswith(b"HTTP/1.1 200 ") and len(served.prompts) == 1
            writer.close()

    asyncio.run(go())


def test_a_body_that_stops_arriving_gets_a_408_and_the_connection_closes() -> None:
    async def go() -> None:
        async with running(RequestLimits(body_timeout_s=0.3)) as (served, port):
            reader, writer = await raw(port, (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"model\": "))
            status, error = error_of(await read_to_eof(reader))
            assert status == 408 and error["code"] == "request_timeout"
            assert "within 0.3 s (--body-timeout)" in error["message"]
            assert served.prompts == []
            writer.close()

    asyncio.run(go())


# ---- the headers' deadline (aiohttp's keep-alive timer: this catches a change of it) ---------


def test_headers_that_stop_arriving_get_the_connection_closed() -> None:
    async def go() -> None:
        async with running(RequestLimits(header_timeout_s=0.3)) as (_, port):
            reader, writer = await raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            assert await read_to_eof(reader) == b""  # closed, nothing sent
            writer.close()
            reader, writer = await raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
            assert head.startswith(b"HTTP/1.1 200 ")  # a complete request is served
            writer.close()

    asyncio.run(go())


def test_a_kept_alive_connection_gets_the_deadline_again_after_each_response() -> None:
    async def go() -> None:
        async with running(RequestLimits(header_timeout_s=0.5)) as (_, port):
            reader, writer = await raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            writer.write(b"GET /v1/models HTTP/1.1\r\n")  # half of the next request
            assert await read_to_eof(reader) == b""
            writer.close()

    asyncio.run(go())


# ---- bad text and ids: 400, never 500 ---------------------------------------------------------


@pytest.mark.parametrize(("path", "raw_body", "param"), [
    ("/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    ("/completions", b'{"model": "tiny", "prompt": "hi", "stop_token_ids": [512]}',
     "stop_token_ids"),
    ("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                          b'"stop": ' + json.dumps(["s"] * 33).encode() + b"}", "stop"),
])
def test_bad_text_and_ids_are_a_400_json(path: str, raw_body: bytes, param: str) -> None:
    async def go() -> None:
        async with running() as (served, port):
            status, body = await post(port, path, raw_body)
            assert (status, body["error"]["param"]) == (400, param)
            assert body["error"]["type"] == "invalid_request_error"
            assert served.prompts == []

    asyncio.run(go())


# ---- long prompts: refused before tokenizing, tokenized off the loop ------------------------


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_the_tokenizer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("the tokenizer saw a prompt that cannot fit")

    monkeypatch.setattr(prepare, "encode_prompt", never)

    async def go() -> None:
        async with running() as (_, port):
            chars = MAX_LEN * 52  # the tiny tokenizer: no token covers more than 52 characters
            for path, body in [("/completions", completion(prompt="x" * chars)),
                               ("/chat/completions", json.dumps({"model": MODEL, "messages": [
                                   {"role": "user", "content": "x" * chars}]}).encode())]:
                status, reply = await post(port, path, body)
                assert status == 400
                assert reply["error"]["code"] == "context_length_exceeded"
                assert "which make at least" in reply["error"]["message"]

    asyncio.run(go())


def test_a_short_prompt_under_the_bound_is_tokenized_and_served() -> None:
    async def go() -> None:
        async with running() as (served, port):
            status, _ = await post(port, "/completions", completion(prompt="Hi there"))
            assert status == 200 and served.prompts[0] == tiny_tokenizer().encode("Hi there")

    asyncio.run(go())


def test_a_long_prompt_is_tokenized_while_the_loop_serves_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer is slowed down (it sleeps); a request for /v1/models sent meanwhile is
    answered before the long prompt's, and the long prompt is tokenized on the pool."""
    threads: list[str] = []
    started = threading.Event()
    encode = prepare.encode_prompt

    def slow_encode(*args: Any, **kwargs: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        started.set()
        time.sleep(1.0)
        return encode(*args, **kwargs)

    monkeypatch.setattr(prepare, "encode_prompt", slow_encode)

    async def go() -> None:
        async with running() as (_, port), aiohttp.ClientSession() as s:
            long = asyncio.ensure_future(post(port, "/completions", completion(
                prompt="Paris is the capital of France. " * 150)))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, SAFETY_S)
            async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                assert r.status == 200
            assert not long.done()
            assert (await long)[0] == 200
            assert threads[0].startswith("pdserve-prepare")
            threads.clear()
            assert (await post(port, "/completions", completion(prompt="Hi")))[0] == 200
            assert threads == ["MainThread"]  # short prompts stay on the loop: no hop

    asyncio.run(go())


def test_a_large_body_is_parsed_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    parse_json = prepare.parse_json

    def spy(raw: bytes) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return parse_json(raw)

    monkeypatch.setattr(prepare, "parse_json", spy)

    async def go() -> None:
        async with running() as (_, port):
            ids = [5] * 400
            pad = "p" * prepare.INLINE_BODY_BYTES  # an ignored field makes the body large
            assert (await post(port, "/completions", completion(prompt=ids, pad=pad)))[0] == 200
            assert (await post(port, "/completions", completion(prompt=ids)))[0] == 200
            assert threads[0].startswith("pdserve-prepare") and threads[1] == "MainThread"

    asyncio.run(go())
