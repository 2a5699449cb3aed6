"""Workers that restart: SIGKILL one, `pdserve up` brings it back at the same ports as a new
instance, and its peer meets the new instance at once, in either direction. Long prompts sent
right after the restart split and move their KV (the decode worker recomputes none), and no
block waits out a lease for the dead instance."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.testing.tiny_models import tiny_tokenizer
from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_faults import all_back
from tests.serve.test_serving import client

PREFILL, DECODE = 0, 1
LEASE_S = 20.0  # blocks held for a dead instance until the lease would fail the waits below
FREE_S = 5.0  # every block is back well inside the lease
AFTER = 32  # long prompts sent at once right after the restart
RECOMPUTES = "pdserve_kv_recomputes_total"
SPLIT = 'pdserve_router_requests_total{path="disaggregated"}'


@pytest.fixture(scope="module")
def _heal_cluster(request, tiny_model) -> Cluster:
    cluster = Cluster(tiny_model(), "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                      "--kv-lease", str(LEASE_S), "--leg-timeout", str(LEASE_S + 5))
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture
def heal_cluster(_heal_cluster: Cluster) -> Cluster:
    """Both tests' cluster, started once for this module: each test gets it once the worker
    that the test before killed is restarted and taken back by the router."""
    return all_back(_heal_cluster)


def long_prompts(n: int, seed: int) -> list[list[int]]:
    """Token-id prompts of 100-300 tokens that no worker has seen (no prefix-cache hit keeps
    them local): each splits into a prefill and a decode leg."""
    rng, vocab = random.Random(seed), len(tiny_tokenizer())
    return [[rng.randrange(vocab) for _ in range(rng.randint(100, 300))] for _ in range(n)]


def serve_split(cluster: Cluster, prompts: list[list[int]]) -> None:
    """Every prompt at once: each completes with its 8 tokens, split into two legs."""
    router = cluster.url.removesuffix("/v1")
    split = metric(router, SPLIT)

    def complete(prompt: list[int]) -> int:
        out = client(cluster).completions.create(model=cluster.model, prompt=prompt,
                                                 max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == [8] * len(prompts)
    assert metric(router, SPLIT) == split + len(prompts)


def restarted(cluster: Cluster, index: int, pid: int) -> dict:
    """Worker `index`'s signed /health once a new process (not `pid`) answers it, and once the
    router has met that instance (its legs name it from then on)."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"worker {index} was not restarted"
        try:
            now = cluster.health(index)
            if now["pid"] != pid:
                break
        except OSError:
            pass
        time.sleep(0.1)
    met = f"new instance {now['peer']['instance_id']}"
    while not any(met in line for line in cluster.log):
        assert time.monotonic() < deadline, f"the router never met {met}"
        time.sleep(0.1)
    return now


def test_a_restarted_prefill_worker_is_met_at_once_and_long_prompts_move_their_kv(
        heal_cluster: Cluster) -> None:
    """The decode worker knew the first prefill instance; the new one at the same address is
    taken at once: no transfer fails on it (no recompute), and every block comes back."""
    cluster = heal_cluster
    serve_split(cluster, long_prompts(2, seed=1))
    before = cluster.health(PREFILL)
    os.kill(before["pid"], signal.SIGKILL)
    now = restarted(cluster, PREFILL, before["pid"])
    assert now["peer"]["port"] == before["peer"]["port"]
    assert now["peer"]["instance_id"] != before["peer"]["instance_id"]
    recomputes = metric(cluster.worker_url(DECODE), RECOMPUTES)
    serve_split(cluster, long_prompts(AFTER, seed=2))
    assert metric(cluster.worker_url(DECODE), RECOMPUTES) == recomputes
    cluster.wait_blocks_free([PREFILL, DECODE], timeout=FREE_S)


def test_a_restarted_decode_worker_is_met_at_once_and_the_prefill_frees_what_it_held(
        heal_cluster: Cluster) -> None:
    """The decode worker freezes, then dies, while the prefill worker holds the KV of prompts
    it computed for it (no reservation ever came): those blocks come back at once, not at the
    lease. The restarted decode instance is then taken at once: long prompts split and move
    their KV, and every block comes back."""
    cluster = heal_cluster
    pid = cluster.health(DECODE)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        stranded = [threading.Thread(target=_fails_or_completes, args=(cluster, prompt))
                    for prompt in long_prompts(4, seed=3)]
        for t in stranded:
            t.start()
        deadline = time.monotonic() + 30
        while not _holding_prefilled(cluster.health(PREFILL)):
            assert time.monotonic() < deadline, "the prefill worker never held the prompts"
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGKILL)
    cluster.wait_blocks_free([PREFILL], timeout=FREE_S)
    for t in stranded:
        t.join(LEASE_S + 10)
    assert not any(t.is_alive() for t in stranded), "a request hung on the dead decode worker"
    restarted(cluster, DECODE, pid)
    serve_split(cluster, long_prompts(AFTER, seed=4))
    assert metric(cluster.worker_url(DECODE), RECOMPUTES) == 0
    cluster.wait_blocks_free([PREFILL, DECODE], timeout=FREE_S)


def _fails_or_completes(cluster: Cluster, prompt: list[int]) -> None:
    with contextlib.suppress(openai.APIError):  # its decode worker died: an error is expected
        client(cluster).completions.create(model=cluster.model, prompt=prompt, max_tokens=8,
                                           temperature=0)


def _holding_prefilled(health: dict) -> bool:
    """Every prompt the prefill worker took is computed, and it holds their KV."""
    return health["kv_blocks_used"] > 0 and health["running"] == health["waiting"] == 0
