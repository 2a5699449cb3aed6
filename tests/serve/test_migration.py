"""A decode worker killed with SIGKILL while it streams: the router continues the stream on the
other decode worker from the exact token (`router/migration.py`), and the client, through the
official `openai` client, receives the very tokens and text an undisturbed run of the same
request gets, with no error: greedy, and seeded sampling (the continuation samples the same
output positions)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.serve.cluster import Cluster, metric
from tests.serve.test_faults import _healthy_in_router
from tests.serve.test_serving import client, prompts

PREFILL, DECODES = 0, (1, 2)
PROMPT = prompts()[2]  # 40 tokens: split (the threshold is 0)
MAX_TOKENS = 400  # within the 512-token context, long enough to be mid-stream at the kill
KILL_AFTER = 8  # tokens the client has when the decode worker is killed
MIGRATED = 'pdserve_router_migrations_total{reason="decode leg failed"}'


@pytest.fixture(scope="module")
def cluster(request, tiny_model) -> Cluster:
    cluster = Cluster(tiny_model(), "--prefill", "1", "--decode", "2",
                      "--local-prefill-threshold", "0")
    request.addfinalizer(cluster.stop)
    return cluster


@dataclass
class Received:
    text: str
    tokens: list[str]  # per token, as the client's logprobs name them
    completion_tokens: int
    finish_reason: str | None


def stream(cluster: Cluster, sampling: dict, on_tokens: Callable[[], None] | None = None
           ) -> Received:
    """The request streamed to its end; `on_tokens()` runs once KILL_AFTER tokens arrived."""
    chunks = client(cluster).completions.create(
        model=cluster.model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, logprobs=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **sampling)
    got = Received("", [], 0, None)
    for chunk in chunks:
        if chunk.choices:
            choice = chunk.choices[0]
            got.text += choice.text
            got.tokens += choice.logprobs.tokens if choice.logprobs else []
            got.finish_reason = choice.finish_reason or got.finish_reason
            if on_tokens is not None and len(got.tokens) >= KILL_AFTER:
                on_tokens()
                on_tokens = None
        if chunk.usage is not None:
            got.completion_tokens = chunk.usage.completion_tokens
    return got


def kill_the_streaming_decode_worker(cluster: Cluster, killed: list[int]) -> None:
    serving = [i for i in DECODES if cluster.health(i)["legs"] > 0]
    assert len(serving) == 1, "exactly one decode worker streams the request"
    os.kill(cluster.health(serving[0])["pid"], signal.SIGKILL)
    killed.append(serving[0])


def wait_all_healthy(cluster: Cluster) -> None:
    """Every worker (a killed one restarted by `pdserve up`) is routable again."""
    router = cluster.url.removesuffix("/v1")
    deadline = time.monotonic() + 120
    for i in (PREFILL, *DECODES):
        while not _healthy_in_router(router, cluster.worker_url(i), cluster.auth):
            assert time.monotonic() < deadline, f"worker {i} never became healthy again"
            time.sleep(0.2)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 42}],
                         ids=["greedy", "seeded"])
def test_a_decode_worker_killed_mid_stream_is_a_pause_not_an_error(cluster: Cluster,
                                                                   sampling: dict) -> None:
    wait_all_healthy(cluster)
    undisturbed = stream(cluster, sampling)
    assert undisturbed.completion_tokens == MAX_TOKENS
    router = cluster.url.removesuffix("/v1")
    migrated, killed = metric(router, MIGRATED), []
    started = time.monotonic()
    disturbed = stream(cluster, sampling,
                       lambda: kill_the_streaming_decode_worker(cluster, killed))
    assert time.monotonic() - started < 60
    assert metric(router, MIGRATED) == migrated + 1
    assert disturbed.completion_tokens == MAX_TOKENS
    assert disturbed.tokens == undisturbed.tokens
    assert disturbed.text == undisturbed.text
    assert disturbed.finish_reason == "length"
    survivor = next(i for i in DECODES if i not in killed)
    cluster.wait_blocks_free([PREFILL, survivor])
