"""A KV lease times a peer's silence, not the queue ahead of its transfer: a burst of long
prompts keeps the prefill worker computing for several leases, and the decode worker, whose
sessions opened as the legs arrived, waits for every one of them (the prefill side HOLDs its
queued transfers) instead of recomputing the prompts itself, or the router prefilling them
again."""

from __future__ import annotations

import math
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.testing.tiny_models import tiny_tokenizer
from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import client

PREFILL, DECODE = 0, 1
LEASE_S = 3.0  # HOLDs every second: a lease of 1.5 s ran out when other work starved the workers
# prompts at once, sized from one prompt's measured time so that the last one waits about
# BUSY_LEASES leases at the prefill worker on any machine (a fixed 36 kept an AVX2 machine's
# prefill worker busy ~11 s, an AVX-512 one's under 6 s)
BUSY_LEASES, MIN_BURST, MAX_BURST = 4, 24, 160
PROMPT_TOKENS, MAX_TOKENS = 400, 4
RECOMPUTES = "pdserve_kv_recomputes_total"
SPLIT = 'pdserve_router_requests_total{path="disaggregated"}'
RETRIES = "pdserve_router_retries_total"


def retries(router: str) -> float:
    """Legs the router retried or recomputed, for any reason."""
    with urllib.request.urlopen(router + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(RETRIES + "{"))


@pytest.fixture
def slow_prefill_cluster(request, tiny_model) -> Cluster:
    # a wider, deeper tiny model: a 400-token prefill takes a good fraction of a second here
    model = tiny_model(hidden_size=384, intermediate_size=1536, num_hidden_layers=6)
    cluster = Cluster(model, "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                      "--kv-lease", str(LEASE_S), "--leg-timeout", "60")
    request.addfinalizer(cluster.stop)
    return cluster


def test_transfers_queued_behind_a_busy_prefill_outlast_the_lease(slow_prefill_cluster):
    cluster = slow_prefill_cluster
    rng, vocab = random.Random(11), len(tiny_tokenizer())
    router = cluster.url.removesuffix("/v1")
    c = client(cluster)  # one client for all: making one each would stagger the burst

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]

    def complete(tokens: list[int], since: float) -> tuple[int, float]:
        out = c.completions.create(model=cluster.model, prompt=tokens, max_tokens=MAX_TOKENS,
                                   temperature=0, extra_body={"ignore_eos": True})
        return out.usage.completion_tokens, time.monotonic() - since

    complete(prompt(), time.monotonic())  # warm-up: the first request pays one-off costs
    one = complete(prompt(), time.monotonic())[1]
    burst = min(MAX_BURST, max(MIN_BURST, math.ceil(BUSY_LEASES * LEASE_S / one)))
    prompts = [prompt() for _ in range(burst)]
    split = metric(router, SPLIT)
    started = time.monotonic()
    with ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(lambda p: complete(p, started), prompts))
    assert [n for n, _ in results] == [MAX_TOKENS] * burst
    assert retries(router) == 0  # the router prefilled none of them again
    assert metric(cluster.worker_url(DECODE), RECOMPUTES) == 0  # nor did the decode worker
    assert metric(router, SPLIT) == split + burst  # every one moved its KV
    # the premise: the prefill worker was busy for more than two leases with this burst
    assert max(took for _, took in results) > 2 * LEASE_S
    cluster.wait_blocks_free([PREFILL, DECODE])
