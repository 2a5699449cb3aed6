"""A prefill host whose link degrades under a running cluster: the router learns that link's
hand-over time from the split requests that cross it, moves long prompts to local prefill on
the decode host while the link is slow, and sends them to the prefill host again once the link
healed and the slow hand-overs are forgotten.

Prompts come in pairs at once, so that the decode worker has one prompt to prefill when the
router decides the other's path: on a fast link the second goes to the prefill host (the
measured-cost rule: its queue empty, the hand-over short), on a slow one it waits for the
decode worker instead. The router's TPOT check is off (--slo-tpot-ms of minutes), so that the
link, not the first prompt's stream, decides. The model is larger than the other testbed
tests' (8 KiB of KV a token; a 600-token prompt: ~0.2 s of prefill on one core of the
development machine, 4.9 MB to hand over, ~65 ms at 1 Gb/s and ~2 s at 20 Mb/s), so that
a hand-over on the fast link is short against a prefill and on the slow one long: ten
prefills, so that the router's estimate, which still weighs the fast hand-overs before the
slow one (~0.7 s with three of them), keeps a decode worker slowed by other work on the
machine (its measured prefill rate then halves) prefilling locally.

On the fast link the second prompt of a pair splits by a margin of a fraction of a prefill,
so a pair may stay local by chance there too: the slow phase counts only the pairs decided
after a slow hand-over was measured."""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.router.link_estimates import MEMORY_S
from pdserve.testbed import lifecycle
from tests.testbed.bed_cluster import BedCluster, cluster_on_bed, metric_value

MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64}
PROMPT_TOKENS = 600
MAX_TOKENS = 4
FAST_GBPS, SLOW_GBPS = 1.0, 0.02
KV_BYTES = PROMPT_TOKENS * 2 * 4 * 4 * 64 * 4  # K and V, 4 layers, 4 heads of 64, fp32
PAIRS = 8  # pairs of prompts a phase may take to show its path
PREFILL, DECODE = 0, 1
SPLIT = 'pdserve_router_split_decisions_total{path="disaggregated",reason="measured_cost"}'
LOCAL = 'pdserve_router_split_decisions_total{path="local",reason="measured_cost"}'


@pytest.fixture
def bed_cluster(tiny_model) -> Iterator[BedCluster]:
    with cluster_on_bed(tiny_model(**MODEL), "--max-model-len", "1024",
                        "--kv-cache-memory", "64MiB", "--slo-tpot-ms", "600000") as cluster:
        yield cluster


def test_a_degraded_prefill_link_moves_long_prompts_to_local_prefill_until_it_heals(
        bed_cluster: BedCluster) -> None:
    c, prefix, rng = bed_cluster, bed_cluster.bed.topology.prefix, random.Random(5)
    labels = f'{{prefill="{c.worker_url(PREFILL)}",decode="{c.worker_url(DECODE)}"}}'
    assert _pairs_until(c, rng, split=True), "on the fast link no prompt went to p0"
    fast_s = _hand_over_s(_router_metrics(c), labels)
    assert fast_s > 0

    lifecycle.set_link(prefix, "p0", gbps=SLOW_GBPS)
    assert _pairs_until(c, rng, split=False, measured_above=(labels, fast_s)), \
        "with p0's link slow prompts still went there"
    split = metric_value(_router_metrics(c), SPLIT)
    for _ in range(2):
        _pair(c, rng)  # while the link is slow, prompts stay on the decode host
    after = _router_metrics(c)
    assert metric_value(after, SPLIT) == split
    # because the link measured slow: a prompt's hand-over estimate above the fast
    # link's (how it compares with the prefill times is the split rule's, measured per step)
    assert _hand_over_s(after, labels) > fast_s

    lifecycle.set_link(prefix, "p0", gbps=FAST_GBPS)
    _until_forgotten(c, labels)
    assert _pairs_until(c, rng, split=True), "after healing no prompt went to p0 again"
    assert _hand_over_s(_router_metrics(c), labels) > 0  # measured again


def _pairs_until(c: BedCluster, rng: random.Random, split: bool,
                 measured_above: tuple[str, float] | None = None) -> bool:
    """Pairs of prompts, at most PAIRS, until one pair has a prompt split by the measured-cost
    rule (`split`), or one has none (not `split`, and at least one decided locally by it).
    `measured_above` (labels, seconds): a pair counts only when the router's hand-over estimate
    of that link was above those seconds before it came."""
    for _ in range(PAIRS):
        before = _router_metrics(c)
        _pair(c, rng)
        after = _router_metrics(c)
        went = metric_value(after, SPLIT) > metric_value(before, SPLIT)
        stayed = metric_value(after, LOCAL) > metric_value(before, LOCAL)
        measured = measured_above is None or _hand_over_s(before, measured_above[0]) > \
            measured_above[1]
        if measured and (went if split else (stayed and not went)):
            return True
    return False


def _pair(c: BedCluster, rng: random.Random) -> None:
    """Two long prompts at once (fresh tokens: no prefix cache helps either)."""
    prompts = [[rng.randrange(500) for _ in range(PROMPT_TOKENS)] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda p: c.complete(p, MAX_TOKENS), prompts))
    assert all(len(d["choices"][0]["text"]) > 0 for d in done)


def _hand_over_s(metrics: str, labels: str) -> float:
    """The router's estimate of a prompt's hand-over on the link of `labels`; 0: none."""
    bandwidth = metric_value(metrics, "pdserve_router_link_bytes_per_second" + labels)
    fixed = metric_value(metrics, "pdserve_router_link_fixed_seconds" + labels)
    return fixed + KV_BYTES / bandwidth if bandwidth else 0.0


def _until_forgotten(c: BedCluster, labels: str) -> None:
    """Until the router no longer holds a hand-over of the link of `labels`."""
    deadline = time.monotonic() + MEMORY_S + 10
    while _hand_over_s(_router_metrics(c), labels) > 0:
        assert time.monotonic() < deadline, "the slow link was never forgotten"
        time.sleep(1)


def _router_metrics(c: BedCluster) -> str:
    url = f"http://{c.address('router')}:{c.port}/metrics"
    with c.inside(), urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
