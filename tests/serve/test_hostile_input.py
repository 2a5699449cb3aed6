"""Hostile input through `pdserve up`'s router: each is refused with OpenAI's error JSON at its
default limits, and the streams that are running meanwhile lose no token.

Raw sockets and aiohttp send what a well-behaved client would not; the `openai` client sends
the normal requests. The deadlines of headers and bodies are tested in-process with short
values (tests/api/test_hostile_http.py): `pdserve up` runs the router with the defaults.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import openai
import pytest

from tests.serve.cluster import Cluster
from tests.serve.test_serving import client, prompts

SAFETY_S = 60.0  # keeps a broken test from hanging; never what a test measures
STREAMS = 8
STREAM_TOKENS = 400  # long enough to run through the hostile request


def router(cluster: Cluster) -> tuple[str, int]:
    return "127.0.0.1", cluster.port


def still_serves(cluster: Cluster) -> None:
    ok = client(cluster).completions.create(model=cluster.model, prompt=prompts()[0],
                                            max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


async def post(url: str, body: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(
            url, data=body, headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=SAFETY_S)) as r:
        return r.status, await r.json(content_type=None)


def test_a_20mb_body_is_a_413_json(collocated: Cluster) -> None:
    body = json.dumps({"model": collocated.model, "prompt": "x" * 20_000_000}).encode()
    status, reply = asyncio.run(post(collocated.url + "/completions", body))
    assert status == 413
    assert reply["error"]["code"] == "request_too_large"
    assert "(--max-body-size)" in reply["error"]["message"]
    still_serves(collocated)


def test_expect_continue_with_a_huge_length_is_a_413_before_any_body(collocated: Cluster
                                                                      ) -> None:
    async def go() -> bytes:
        reader, writer = await asyncio.open_connection(*router(collocated))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000000\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SAFETY_S)
        writer.close()
        return head

    assert asyncio.run(go()).startswith(b"HTTP/1.1 413 ")
    still_serves(collocated)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completions", b'{"model": "MODEL", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", '
                          b'"content": "x\\udc00"}], "max_tokens": 2}', "messages"),
])
def test_a_lone_surrogate_is_a_400(collocated: Cluster, path: str, body: bytes,
                                   param: str) -> None:
    body = body.replace(b"MODEL", collocated.model.encode())
    status, reply = asyncio.run(post(collocated.url + path, body))
    assert (status, reply["error"]["param"]) == (400, param)
    assert "unpaired surrogate" in reply["error"]["message"]
    still_serves(collocated)


def test_out_of_vocabulary_stop_token_ids_are_a_400(collocated: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(collocated).completions.create(
            model=collocated.model, prompt="hi", max_tokens=2,
            extra_body={"stop_token_ids": [3, 10**9]})
    assert info.value.body["param"] == "stop_token_ids"
    assert "[0, 512)" in info.value.body["message"]


class Stream:
    """One streamed completion of exactly STREAM_TOKENS tokens, with its chunks' arrivals."""

    def __init__(self, cluster: Cluster, prompt: list[int]) -> None:
        self.cluster, self.prompt = cluster, prompt
        self.arrivals: list[float] = []
        self.started = threading.Event()
        self.tokens = 0
        self.finish: str | None = None

    def run(self) -> None:
        stream = client(self.cluster).completions.create(
            model=self.cluster.model, prompt=self.prompt, max_tokens=STREAM_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        for chunk in stream:
            self.arrivals.append(time.perf_counter())
            self.started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                self.finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                self.tokens = chunk.usage.completion_tokens

    def worst_gap_during(self, t0: float, t1: float) -> float:
        """The longest wait for a chunk that overlaps [t0, t1]."""
        pairs = zip(self.arrivals, self.arrivals[1:], strict=False)
        gaps = [b - a for a, b in pairs if b >= t0 and a <= t1]
        return max(gaps, default=0.0)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(collocated: Cluster
                                                                    ) -> None:
    body = json.dumps({"model": collocated.model, "prompt": "Paris. " * 30_000}).encode()
    status, reply = asyncio.run(post(collocated.url + "/completions", body))
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "which make at least" in reply["error"]["message"]


def test_a_10mb_body_while_8_streams_run(collocated: Cluster) -> None:
    streams = [Stream(collocated, prompts()[0][:8]) for _ in range(STREAMS)]
    body = json.dumps({"model": collocated.model, "prompt": "Paris. " * 1_500_000}).encode()
    assert 10_000_000 <= len(body) < 16 * 2**20
    with ThreadPoolExecutor(STREAMS) as pool:
        running = [pool.submit(s.run) for s in streams]
        for s in streams:
            assert s.started.wait(SAFETY_S)
        t0 = time.perf_counter()
        status, reply = asyncio.run(post(collocated.url + "/completions", body))
        t1 = time.perf_counter()
        for r in running:
            r.result(timeout=SAFETY_S)
    # refused before it is parsed: no request that fits a 512-token context is that large
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    assert "fits this model's context" in reply["error"]["message"]
    assert all(s.arrivals[-1] > t1 for s in streams)  # every stream ran through it
    assert [(s.tokens, s.finish) for s in streams] == [(STREAM_TOKENS, "length")] * STREAMS
    worst = max(s.worst_gap_during(t0, t1) for s in streams)
    print(f"10 MB body answered in {1e3 * (t1 - t0):.0f} ms; the streams' worst gap during "
          f"it: {1e3 * worst:.1f} ms")
