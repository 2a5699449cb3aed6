"""Faults through real processes: a stop on token 0, clients that go away mid-stream and
mid-transfer, a prefill worker killed with SIGKILL under load or stalled with SIGSTOP, a
restarted one, a decode worker killed mid-stream. Each ends in bounded time with every KV block
back in its pool."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from pdserve.internal_auth import InternalAuth
from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import client, prompts

PREFILL, DECODE = 0, 1
LONG = prompts()[5]  # 300 tokens: split into prefill and decode legs
assert len(LONG) > LOCAL_THRESHOLD


def test_stop_on_token0_ends_after_prefill_and_frees_the_reservation(disagg_tcp: Cluster
                                                                     ) -> None:
    c = client(disagg_tcp)
    first = c.completions.create(model=disagg_tcp.model, prompt=LONG, max_tokens=1,
                                 temperature=0, logprobs=0)
    token0_text = first.choices[0].text
    recomputes = metric(disagg_tcp.worker_url(DECODE), "pdserve_kv_recomputes_total")
    from pdserve import LLM, SamplingParams

    llm = LLM(model=disagg_tcp.model, dtype="float32", max_model_len=512)
    t0 = llm.generate([LONG], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    token0 = t0[0].outputs[0].token_ids[0]
    out = c.completions.create(model=disagg_tcp.model, prompt=LONG, max_tokens=50,
                               temperature=0, extra_body={"stop_token_ids": [token0]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 1
    assert token0_text is not None
    disagg_tcp.wait_blocks_free([PREFILL, DECODE], timeout=3.0)  # the lease is 30 s
    assert metric(disagg_tcp.worker_url(DECODE), "pdserve_kv_recomputes_total") == recomputes


def test_client_gone_mid_stream_frees_both_sides(disagg_tcp: Cluster) -> None:
    stream = client(disagg_tcp).completions.create(
        model=disagg_tcp.model, prompt=LONG, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    got = [next(stream) for _ in range(3)]
    assert all(ch.choices for ch in got)
    stream.close()
    disagg_tcp.wait_blocks_free([PREFILL, DECODE])
    deadline = time.monotonic() + 5
    while metric(disagg_tcp.worker_url(DECODE), "pdserve_requests_cancelled_total") < 1:
        assert time.monotonic() < deadline, "the decode worker never saw the cancel"
        time.sleep(0.1)


def test_client_gone_mid_transfer_frees_both_sides(disagg_tcp: Cluster) -> None:
    c = openai.OpenAI(base_url=disagg_tcp.url, api_key="unused", max_retries=0, timeout=0.02)
    for _ in range(6):
        with pytest.raises(openai.APITimeoutError):
            c.completions.create(model=disagg_tcp.model, prompt=LONG, max_tokens=200,
                                 temperature=0, extra_body={"ignore_eos": True})
    disagg_tcp.wait_blocks_free([PREFILL, DECODE])
    ok = client(disagg_tcp).completions.create(model=disagg_tcp.model, prompt=LONG,
                                               max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


@pytest.fixture(scope="module")
def _kill_cluster(request, tiny_model) -> Cluster:
    cluster = Cluster(tiny_model(), "--local-prefill-threshold", str(LOCAL_THRESHOLD))
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture
def kill_cluster(_kill_cluster: Cluster) -> Cluster:
    """The kill tests' cluster, started once for this module: each test gets it once a worker
    that the test before killed is restarted and taken back by the router."""
    return all_back(_kill_cluster)


def all_back(cluster: Cluster) -> Cluster:
    """`cluster` once both workers answer their signed /health (a killed one: its restarted
    process) and the router lists both healthy."""
    router, deadline = cluster.url.removesuffix("/v1"), time.monotonic() + 60
    for index in (PREFILL, DECODE):
        while not (_answers(cluster, index)
                   and _healthy_in_router(router, cluster.worker_url(index), cluster.auth)):
            assert time.monotonic() < deadline, f"worker {index} did not come back"
            time.sleep(0.1)
    return cluster


def _answers(cluster: Cluster, index: int) -> bool:
    try:
        cluster.health(index)
    except OSError:
        return False
    return True


def test_prefill_killed_under_load_every_request_ends_and_decode_frees(kill_cluster: Cluster
                                                                       ) -> None:
    """SIGKILL the prefill worker while requests stream: each one completes (the decode worker
    recomputes what it could not receive) or ends with an error, within a bound; afterwards
    the decode pool holds no block and new requests are still served."""
    cluster = kill_cluster
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()
    killed_at: list[float] = []

    def one(i: int) -> None:
        try:
            stream = client(cluster).completions.create(
                model=cluster.model, prompt=prompts()[3 + i % 3], max_tokens=120,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            n = sum(1 for ch in stream if ch.choices and ch.choices[0].text is not None)
            result = "completed" if n > 0 else "empty"
        except openai.APIError as e:
            result = f"error: {e}"
        with lock:
            outcomes.append((result, time.monotonic()))

    pid = cluster.health(PREFILL)["pid"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.03)
        if i == 5:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung after the prefill died"
    assert len(outcomes) == 12
    assert all(r == "completed" or r.startswith("error") for r, _ in outcomes), outcomes
    assert max(when for _, when in outcomes) - killed_at[0] < 30
    cluster.wait_blocks_free([DECODE])
    after = client(cluster).completions.create(model=cluster.model, prompt=LONG, max_tokens=4,
                                               temperature=0)
    assert after.usage.completion_tokens == 4
    cluster.wait_blocks_free([DECODE])


def test_a_restarted_prefill_worker_is_a_new_peer_at_the_old_address(kill_cluster: Cluster
                                                                      ) -> None:
    """`pdserve up` restarts a killed worker at the same ports; the router and the decode
    worker take the new instance (new instance id) and long prompts split again."""
    cluster = kill_cluster
    before = cluster.health(PREFILL)
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the prefill worker was not restarted"
        try:
            now = cluster.health(PREFILL)
            if now["pid"] != before["pid"]:
                break
        except OSError:
            pass
        time.sleep(0.2)
    assert now["peer"]["instance_id"] != before["peer"]["instance_id"]
    assert now["peer"]["port"] == before["peer"]["port"]
    router = cluster.url.removesuffix("/v1")
    met = f"new instance {now['peer']['instance_id']}"
    while not any(met in line for line in cluster.log):  # the router's health round met it
        assert time.monotonic() < deadline, f"the router never met {met}"
        time.sleep(0.1)
    split = metric(router, 'pdserve_router_requests_total{path="disaggregated"}')
    recomputes = metric(cluster.worker_url(DECODE), "pdserve_kv_recomputes_total")
    fresh = LONG[::-1]  # the decode worker's prefix cache may hold LONG: it would run locally
    out = client(cluster).completions.create(model=cluster.model, prompt=fresh, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    assert metric(router, 'pdserve_router_requests_total{path="disaggregated"}') == split + 1
    assert metric(cluster.worker_url(DECODE), "pdserve_kv_recomputes_total") == recomputes
    cluster.wait_blocks_free([PREFILL, DECODE])


def test_the_only_decode_worker_killed_mid_stream_continues_after_its_restart(
        kill_cluster: Cluster) -> None:
    """SIGKILL the one decode worker after tokens reached the client: the router waits for
    the restarted worker and continues the stream there from the exact token (the prompt and
    the tokens sent recomputed), so the client sees a pause and the very text an undisturbed
    run gives, not an error."""
    cluster = kill_cluster
    max_tokens = 400 - len(LONG) + 100
    reference = client(cluster).completions.create(
        model=cluster.model, prompt=LONG, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text
    stream = client(cluster).completions.create(
        model=cluster.model, prompt=LONG, max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    text = next(stream).choices[0].text
    os.kill(cluster.health(DECODE)["pid"], signal.SIGKILL)
    started = time.monotonic()
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == reference
    assert time.monotonic() - started < 90  # a restart and a recompute, bounded
    router = cluster.url.removesuffix("/v1")
    with urllib.request.urlopen(router + "/metrics", timeout=5) as r:
        moved = [line for line in r.read().decode().splitlines()
                 if line.startswith("pdserve_router_migrations_total{")]
    assert sum(float(line.split()[-1]) for line in moved) >= 1, moved
    cluster.wait_blocks_free([PREFILL, DECODE])


STALL_LEASE_S = 2.0
STALL_LEG_TIMEOUT_S = 5.0  # above the lease: a decode leg is silent for up to a lease
STALL_QUEUE_WAIT_S = 2.0  # how long the router then waits for the worker to serve again


def _stall_cluster(request: pytest.FixtureRequest, tiny_model: Callable[..., Path]) -> Cluster:
    cluster = Cluster(tiny_model(), "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                      "--kv-lease", str(STALL_LEASE_S), "--leg-timeout", str(STALL_LEG_TIMEOUT_S),
                      "--max-queue-wait-s", str(STALL_QUEUE_WAIT_S))
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture(scope="module")
def _stall_cluster_shared(request, tiny_model) -> Cluster:
    return _stall_cluster(request, tiny_model)


@pytest.fixture
def stall_cluster(_stall_cluster_shared: Cluster) -> Cluster:
    """The stall tests' cluster, started once for this module (each test wakes what it stalled
    and waits until the split path works again): each test gets it once the router has both
    workers back."""
    return all_back(_stall_cluster_shared)


@pytest.fixture
def fresh_stall_cluster(request, tiny_model) -> Cluster:
    """A cluster of the stall tests' settings whose workers have never moved KV (never
    dialed each other), stopped after the test."""
    return _stall_cluster(request, tiny_model)


def _splits_again_without_recompute(cluster: Cluster) -> None:
    """The router takes the woken prefill worker back, and a long prompt splits with its KV
    arriving (no recompute); then every block is back on both sides."""
    router = cluster.url.removesuffix("/v1")
    deadline = time.monotonic() + 10
    while not _healthy_in_router(router, cluster.worker_url(PREFILL), cluster.auth):
        assert time.monotonic() < deadline, "the router never took the prefill worker back"
        time.sleep(0.2)
    split = metric(router, 'pdserve_router_requests_total{path="disaggregated"}')
    recomputes = metric(cluster.worker_url(DECODE), "pdserve_kv_recomputes_total")
    fresh = LONG[::-1]  # the decode worker's prefix cache may hold LONG: it would run locally
    out = client(cluster).completions.create(model=cluster.model, prompt=fresh, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    assert metric(router, 'pdserve_router_requests_total{path="disaggregated"}') == split + 1
    assert metric(cluster.worker_url(DECODE), "pdserve_kv_recomputes_total") == recomputes
    cluster.wait_blocks_free([PREFILL, DECODE])


def test_a_stalled_prefill_worker_costs_a_lease_not_a_hang(stall_cluster: Cluster) -> None:
    """SIGSTOP the prefill worker while long prompts stream: alive and connected but silent (a
    frozen host, a long GC pause). Every request still completes: its decode worker gives up
    on the KV after the lease and recomputes; the router stops sending prompts to a worker
    that does not answer /health. After SIGCONT the stalled worker frees all it held (its
    legs were closed, its transfers refused) and long prompts split again."""
    cluster = stall_cluster
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            out = client(cluster).completions.create(
                model=cluster.model, prompt=prompts()[3 + i % 3], max_tokens=30,
                temperature=0, extra_body={"ignore_eos": True})
            result = f"{out.usage.completion_tokens} tokens"
        except openai.APIError as e:
            result = f"error: {e}"
        with lock:
            outcomes.append((result, time.monotonic()))

    # one split request first: the decode worker's transfer connection to the prefill worker
    # is up before the stall, so the reservations reach the stalled worker (a stall before the
    # first dial is the next test: there they wait behind the handshake)
    one(0)
    assert outcomes.pop()[0] == "30 tokens"
    pid = cluster.health(PREFILL)["pid"]
    recomputes = metric(cluster.worker_url(DECODE), "pdserve_kv_recomputes_total")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    try:
        for i, t in enumerate(threads):
            t.start()
            time.sleep(0.05)
            if i == 1:
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request hung on the stalled worker"
        assert [r for r, _ in outcomes] == ["30 tokens"] * 8, outcomes
        # the lease and the recompute; never the router's 60 s leg timeout
        assert max(when for _, when in outcomes) - stopped_at < 3 * STALL_LEASE_S + 5
        assert metric(cluster.worker_url(DECODE), "pdserve_kv_recomputes_total") > recomputes
        # the router took the silent prefill worker out at the first recompute, before its
        # health checks would have (three missed checks)
        router = cluster.url.removesuffix("/v1")
        assert metric(router, 'pdserve_router_retries_total{reason="prefill silent, decode '
                              'recomputed"}') >= 1
        assert not _healthy_in_router(router, cluster.worker_url(PREFILL), cluster.auth)
        time.sleep(1)
        held = cluster.health(DECODE)["kv_blocks_used"]  # reserved for the stalled writer
    finally:
        os.kill(pid, signal.SIGCONT)
    # it wakes, fences its writes and says so: every block comes back on both sides
    cluster.wait_blocks_free([PREFILL, DECODE])
    assert held > 0
    _splits_again_without_recompute(cluster)


def test_a_prefill_worker_stalled_before_its_first_transfer_serves_again_when_it_wakes(
        fresh_stall_cluster: Cluster) -> None:
    """SIGSTOP the prefill worker before any KV moved: the decode worker's first dial to it
    finds its kernel accepting and its process silent. The request costs the lease and a
    recompute; after SIGCONT the pair works again: the next long prompt splits and its KV
    arrives (a handshake that timed out used to declare the peer dead for good, so every later
    transfer between the two failed and recomputed)."""
    cluster = fresh_stall_cluster
    pid = cluster.health(PREFILL)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        out = client(cluster).completions.create(
            model=cluster.model, prompt=prompts()[3], max_tokens=30, temperature=0,
            extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 30
        assert time.monotonic() - started < 3 * STALL_LEASE_S + 5
    finally:
        os.kill(pid, signal.SIGCONT)
    cluster.wait_blocks_free([PREFILL, DECODE])
    _splits_again_without_recompute(cluster)


def test_a_stalled_decode_worker_ends_the_stream_within_the_leg_timeout(stall_cluster: Cluster
                                                                         ) -> None:
    """SIGSTOP the decode worker after tokens reached the client: the stream ends with an error
    once the leg was silent for `--leg-timeout` and no worker served again within
    `--max-queue-wait-s` (not minutes); the prefill worker frees what it
    sent within its lease while the decode worker is still stopped; after SIGCONT the decode
    worker drops the abandoned leg and serves again."""
    cluster = stall_cluster
    stream = client(cluster).completions.create(
        model=cluster.model, prompt=LONG, max_tokens=400 - len(LONG) + 100, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    next(stream)
    next(stream)
    pid = cluster.health(DECODE)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert time.monotonic() - started < STALL_LEG_TIMEOUT_S + STALL_QUEUE_WAIT_S + 5
        cluster.wait_blocks_free([PREFILL], timeout=STALL_LEASE_S + 10)
    finally:
        os.kill(pid, signal.SIGCONT)
    cluster.wait_blocks_free([PREFILL, DECODE])
    router = cluster.url.removesuffix("/v1")
    deadline = time.monotonic() + 10
    while not _healthy_in_router(router, cluster.worker_url(DECODE), cluster.auth):
        assert time.monotonic() < deadline, "the router never took the decode worker back"
        time.sleep(0.2)
    out = client(cluster).completions.create(model=cluster.model, prompt=LONG[::-1],
                                             max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    cluster.wait_blocks_free([PREFILL, DECODE])


def _healthy_in_router(router: str, worker_url: str, auth: InternalAuth) -> bool:
    """Whether the router lists the worker as healthy (the list needs a signed request); its
    /health answers 503 (with the same body) while no decode worker is healthy."""
    signed = urllib.request.Request(router + "/health", headers=auth.headers("GET", "/health"))
    try:
        with urllib.request.urlopen(signed, timeout=5) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        body = e.read()
    return any(w["url"] == worker_url and w["healthy"] for w in json.loads(body)["workers"])
