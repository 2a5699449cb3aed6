"""A cluster across the hosts of a testbed (`pdserve up --testbed`): the router on host router,
the prefill worker on p0, the decode worker on d0, each in its own network namespace. Split
requests move their KV over the shaped link between p0 and d0 (tcp, tcp sealed with
AES-256-GCM, and NIXL, whose UCX is kept on the link: it would take cross-memory attach between
two processes of one machine otherwise) and give the greedy tokens of the offline engine on
one host."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.testbed.bed_cluster import (
    MAX_TOKENS,
    BedCluster,
    cluster_on_bed,
    metric_value,
    offline_texts,
)

THRESHOLD = 16  # prompts longer than this are split across p0 and d0
PREFILL, DECODE = 0, 1
RECV_BYTES = 'pdserve_transfer_bytes_total{direction="recv"}'


def long_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(500) for _ in range(n)] for n in (40, 150, 300)]


TRANSPORTS = {"tcp": ("--transport", "tcp"), "tcp-aes": ("--transport", "tcp", "--kv-encrypt"),
              "nixl": ("--transport", "nixl")}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def bed_cluster(request, tiny_model) -> Iterator[BedCluster]:
    if request.param == "nixl":
        pytest.importorskip("nixl_cu12")
    with cluster_on_bed(tiny_model(), "--local-prefill-threshold", str(THRESHOLD),
                        *TRANSPORTS[request.param]) as cluster:
        yield cluster


def test_split_requests_across_hosts_give_the_one_host_greedy_tokens(
        bed_cluster: BedCluster) -> None:
    texts = [bed_cluster.complete(p, MAX_TOKENS)["choices"][0]["text"] for p in long_prompts()]
    assert texts == offline_texts(bed_cluster.model, long_prompts())
    decode = bed_cluster.metrics(DECODE)
    assert metric_value(decode, RECV_BYTES) > 0  # the KV came over the p0-d0 link
    assert metric_value(decode, "pdserve_kv_recomputes_total") == 0
    bed_cluster.wait_blocks_free([PREFILL, DECODE])
    if "nixl" in bed_cluster.proc.args:
        _assert_ucx_kept_to_the_link("\n".join(bed_cluster.log))


def test_workers_advertise_their_hosts_address_for_kv(bed_cluster: BedCluster) -> None:
    for index, host in ((PREFILL, "p0"), (DECODE, "d0")):
        peer = bed_cluster.health(index)["peer"]
        assert peer["host"] == bed_cluster.address(host)
        assert peer["port"] == bed_cluster.port + 101 + index



def _assert_ucx_kept_to_the_link(log: str) -> None:
    """The workers print the protocols UCX chose (UCX_PROTO_INFO): the peer is another node,
    reached over tcp on the host's link; no shared-memory or cross-memory-attach transport."""
    assert "inter-node" in log and "tcp/eth0" in log
    assert not any(shm in log for shm in ("cma/", "posix/", "sysv/", "intra-node"))
