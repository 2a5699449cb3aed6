"""Pressure through real processes. A burst of long prompts larger than both workers' KV pools
(the decode pre-allocation failure users of other systems report): admission control queues
what does not fit on either side; every request completes, nothing crashes, every block comes
back. Many transfers at once (the failures under high concurrency others report): all land."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import client, prompts

POOL = "288KiB"  # 36 blocks of the tiny model per worker: two 300-token prompts fill it
BURST = 16
MAX_TOKENS = 30


@pytest.fixture
def small_pools(request, tiny_model) -> Cluster:
    cluster = Cluster(tiny_model(), "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                      "--kv-cache-memory", POOL)
    request.addfinalizer(cluster.stop)
    return cluster


def test_a_burst_larger_than_both_kv_pools_queues_and_completes(small_pools: Cluster) -> None:
    cluster = small_pools
    total = [cluster.health(i)["kv_blocks_total"] for i in (0, 1)]
    long_prompts = prompts()[3:]  # 100, 230 and 300 tokens: each split into two legs
    need = sum(-(-(len(long_prompts[i % 3]) + MAX_TOKENS) // 16) for i in range(BURST))
    assert need > 4 * max(total)  # the burst needs several pools' worth on each side
    results: list[object] = []

    def one(i: int) -> None:
        prompt = [(t + i) % 500 for t in long_prompts[i % 3]]  # distinct: no prefix hits
        try:
            out = client(cluster).completions.create(
                model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
            results.append(out.usage.completion_tokens)
        except openai.APIError as e:
            results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung under KV pressure"
    assert results == [MAX_TOKENS] * BURST
    cluster.wait_blocks_free([0, 1])


@pytest.mark.parametrize("transport", ["disagg_tcp", "disagg_nixl"])
def test_many_concurrent_transfers_all_land(request, transport: str) -> None:
    """48 long prompts at once, each split: every KV transfer lands (no failure, no recompute
    on the decode worker) and every greedy output is the offline engine's."""
    cluster: Cluster = request.getfixturevalue(transport)
    decode = cluster.worker_url(1)
    router, split = cluster.url.removesuffix("/v1"), SPLIT_METRIC
    before = {name: metric(decode, name) for name in RECV_FAILURE_METRICS}
    split_before = metric(router, split)
    batch = _concurrent_batch()

    def one(prompt: list[int]) -> str:
        return client(cluster).completions.create(
            model=cluster.model, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(len(batch)) as pool:
        texts = list(pool.map(one, batch))
    assert texts == _offline_batch_texts(cluster.model)
    assert metric(router, split) == split_before + len(batch)
    assert {name: metric(decode, name) for name in RECV_FAILURE_METRICS} == before
    cluster.wait_blocks_free([0, 1])


def _concurrent_batch() -> list[list[int]]:
    # shifted: none is a prompt other tests of a session-wide cluster sent (no cache hit)
    return [[(t + i + 1) % 500 for t in prompts()[3 + i % 3]] for i in range(48)]


@functools.cache
def _offline_batch_texts(model: str) -> list[str]:
    """The offline engine's greedy texts of the batch: computed once for every transport."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=512)
    offline = llm.generate(_concurrent_batch(),
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    return [o.outputs[0].text for o in offline]


SPLIT_METRIC = 'pdserve_router_requests_total{path="disaggregated"}'
RECV_FAILURE_METRICS = ('pdserve_transfer_failures_total{direction="recv"}',
                        "pdserve_kv_recomputes_total")
