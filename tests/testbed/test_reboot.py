"""A prefill host that reboots: its worker killed with SIGKILL and started again by `pdserve
up` at the same address with a new instance id. The decode host takes the new instance as a
new peer (the old one is dead for good, so nothing of it is accepted any more), split requests
move their KV over the link again without recomputing, and no block stays used on either
side."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator

import pytest

from tests.testbed.bed_cluster import (
    MAX_TOKENS,
    BedCluster,
    cluster_on_bed,
    metric_value,
    offline_texts,
)
from tests.testbed.test_cross_host import RECV_BYTES, THRESHOLD

PREFILL, DECODE = 0, 1
RECOMPUTES = "pdserve_kv_recomputes_total"


def prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [[rng.randrange(500) for _ in range(n)] for n in (80, 150)]


@pytest.fixture
def bed_cluster(tiny_model) -> Iterator[BedCluster]:
    with cluster_on_bed(tiny_model(), "--local-prefill-threshold", str(THRESHOLD)) as cluster:
        yield cluster


def _restarted(c: BedCluster, before: dict) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            now = c.health(PREFILL)
            if now["pid"] != before["pid"]:
                return now
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the prefill worker on p0 was not restarted\n" + "\n".join(c.log))


def test_a_rebooted_prefill_host_is_a_new_peer_and_kv_moves_from_it_again(
        bed_cluster: BedCluster) -> None:
    c = bed_cluster
    expected = offline_texts(c.model, prompts())
    assert c.complete(prompts()[0], MAX_TOKENS)["choices"][0]["text"] == expected[0]
    before = c.health(PREFILL)

    os.kill(before["pid"], signal.SIGKILL)
    now = _restarted(c, before)
    assert now["peer"]["instance_id"] != before["peer"]["instance_id"]
    assert (now["peer"]["host"], now["peer"]["port"]) == (before["peer"]["host"],
                                                          before["peer"]["port"])
    assert now["peer"]["host"] == c.address("p0")
    time.sleep(1.5)  # one router health round: it learns the new instance

    received = metric_value(c.metrics(DECODE), RECV_BYTES)
    recomputes = metric_value(c.metrics(DECODE), RECOMPUTES)
    assert c.complete(prompts()[1], MAX_TOKENS)["choices"][0]["text"] == expected[1]
    assert metric_value(c.metrics(DECODE), RECV_BYTES) > received  # from the new instance
    assert metric_value(c.metrics(DECODE), RECOMPUTES) == recomputes
    c.wait_blocks_free([PREFILL, DECODE])
