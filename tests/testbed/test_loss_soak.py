"""Two minutes of 16 client streams while every link of the testbed drops 1% of its packets:
no request fails, each gets every token it asked for, and no KV block stays used afterwards.
Every link also delays by 5 ms with 5 ms of jitter, where the testbed can delay (netem, or the
delay line: iptables' NFQUEUE).

Marked `soak`: `make soak` runs it; the README's test command leaves it out."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.testbed import lifecycle
from pdserve.testbed.state import DelayMethod
from tests.testbed.bed_cluster import MAX_TOKENS, BedCluster, cluster_on_bed
from tests.testbed.test_cross_host import THRESHOLD

SOAK_S = 120.0
STREAMS = 16
LOSS_PCT = 1.0
JITTER_MS = 5.0
PREFILL, DECODE = 0, 1


@pytest.fixture
def bed_cluster(tiny_model) -> Iterator[BedCluster]:
    with cluster_on_bed(tiny_model(), "--local-prefill-threshold", str(THRESHOLD)) as cluster:
        yield cluster


def _client(c: BedCluster, seed: int, until: float, done: list[int],
            failures: list[str]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        prompt = [rng.randrange(500) for _ in range(rng.randrange(8, 200))]
        try:
            out = c.complete(prompt, MAX_TOKENS, timeout_s=120)
            if out["usage"]["completion_tokens"] != MAX_TOKENS:
                failures.append(f"{len(prompt)}-token prompt: {out['usage']}")
            else:
                done.append(len(prompt))
        except Exception as e:
            failures.append(f"{len(prompt)}-token prompt: {e!r}")


@pytest.mark.soak
def test_sixteen_streams_over_lossy_links_for_two_minutes_fail_no_request(
        bed_cluster: BedCluster) -> None:
    c, prefix = bed_cluster, bed_cluster.bed.topology.prefix
    jitter = {"delay_ms": JITTER_MS, "jitter_ms": JITTER_MS} \
        if c.bed.delay is not DelayMethod.NONE else {}
    for host in ("router", "p0", "d0"):
        lifecycle.set_link(prefix, host, loss_pct=LOSS_PCT, **jitter)
    done: list[int] = []
    failures: list[str] = []
    until = time.monotonic() + SOAK_S
    clients = [threading.Thread(target=_client, args=(c, i, until, done, failures))
               for i in range(STREAMS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(SOAK_S + 180)
    assert not failures, f"{len(failures)} of {len(failures) + len(done)} failed: {failures[:5]}"
    assert len(done) >= STREAMS
    assert sum(n > THRESHOLD for n in done) > len(done) // 2  # most were split across hosts
    for host in ("router", "p0", "d0"):
        lifecycle.set_link(prefix, host, loss_pct=0.0)
    c.wait_blocks_free([PREFILL, DECODE])
