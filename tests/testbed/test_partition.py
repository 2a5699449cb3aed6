"""A partition (every packet dropped, both ways) between the prefill host and the decode host
of a running cluster: split requests still end, in bounded time (the KV lease, or the TCP
keepalive that finds the peer gone, whichever comes first), with the one-host greedy tokens
(the decode worker recomputes what it could not receive), and no KV block stays used on
either side; each worker's metrics show its peer lost until the pause before it is dialed
again; once the link heals, the same two processes move KV over it again. The router's own
links to both hosts are untouched."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from pdserve.testbed import lifecycle
from pdserve.transfer.tcp import peers
from tests.testbed.bed_cluster import (
    MAX_TOKENS,
    BedCluster,
    cluster_on_bed,
    metric_value,
    offline_texts,
)
from tests.testbed.test_cross_host import RECV_BYTES, THRESHOLD

LEASE_S = 3.0
KEEPALIVE_S = 12.0  # the tcp transport's keepalive finds a silent peer within ~10 s
PREFILL, DECODE = 0, 1
RECOMPUTES = "pdserve_kv_recomputes_total"
PEERS_LOST = "pdserve_transfer_peers_lost"


def prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(500) for _ in range(n)] for n in (60, 120, 200, 90)]


@pytest.fixture
def bed_cluster(tiny_model) -> Iterator[BedCluster]:
    with cluster_on_bed(tiny_model(), "--local-prefill-threshold", str(THRESHOLD),
                        "--kv-lease", str(LEASE_S)) as cluster:
        yield cluster


def peers_lost(c: BedCluster) -> list[float]:
    return [metric_value(c.metrics(i), PEERS_LOST) for i in (PREFILL, DECODE)]


def wait_lost_on_both_sides(c: BedCluster, timeout: float) -> None:
    """Until each worker's metrics have said it holds its peer behind the partition lost."""
    deadline, seen = time.monotonic() + timeout, [False, False]
    while not all(seen):
        seen = [was or now == 1 for was, now in zip(seen, peers_lost(c), strict=True)]
        if time.monotonic() > deadline:
            raise AssertionError(f"lost seen (prefill, decode): {seen}:\n" + "\n".join(c.log))
        time.sleep(0.1)


def test_a_partition_between_prefill_and_decode_hosts_ends_requests_and_leaks_no_block(
        bed_cluster: BedCluster) -> None:
    c, prefix = bed_cluster, bed_cluster.bed.topology.prefix
    expected = offline_texts(c.model, prompts())
    first, during, after = prompts()[0], prompts()[1:3], prompts()[3]
    assert c.complete(first, MAX_TOKENS)["choices"][0]["text"] == expected[0]
    assert metric_value(c.metrics(DECODE), RECV_BYTES) > 0  # the link carried KV before

    lifecycle.partition(prefix, "p0", "d0")
    for prompt, text in zip(during, expected[1:3], strict=True):
        t0 = time.monotonic()
        got = c.complete(prompt, MAX_TOKENS, timeout_s=60)["choices"][0]["text"]
        assert time.monotonic() - t0 < max(LEASE_S, KEEPALIVE_S) + 10
        assert got == text
    assert metric_value(c.metrics(DECODE), RECOMPUTES) >= 1
    c.wait_blocks_free([PREFILL, DECODE], timeout=LEASE_S + KEEPALIVE_S + 10)
    # each side holds the other lost from its keepalive's verdict on, which may come after
    # the blocks are free, and dials it again only LOST_RETRY_S later
    wait_lost_on_both_sides(c, timeout=KEEPALIVE_S + 10)

    lifecycle.heal(prefix, "p0", "d0")
    time.sleep(peers.LOST_RETRY_S)
    assert peers_lost(c) == [0, 0]  # both due to be dialed again
    recomputes = metric_value(c.metrics(DECODE), RECOMPUTES)
    received = metric_value(c.metrics(DECODE), RECV_BYTES)
    assert c.complete(after, MAX_TOKENS)["choices"][0]["text"] == expected[3]
    c.wait_blocks_free([PREFILL, DECODE])
    # the healed link carried the KV: no restart of either worker was needed
    assert metric_value(c.metrics(DECODE), RECOMPUTES) == recomputes
    assert metric_value(c.metrics(DECODE), RECV_BYTES) > received
