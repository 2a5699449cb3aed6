"""`pdserve up` serving the tiny DeepSeek-V3 disaggregated over tcp, streaming the latent pool
layer by layer: the same greedy tokens as the offline engine (whose tokens equal transformers',
tests/engine/test_deepseek.py), with the KV moved as the latent layout."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.transfer.layout import LAYOUT_PAGED_MLA
from tests.serve.cluster import Cluster
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import LENGTHS, _complete, _metric, _offline_texts, _scrape, prompts


@pytest.fixture(scope="module")
def deepseek_tcp(request, tiny_model) -> Cluster:
    cluster = Cluster(tiny_model("deepseek_v3"), "--local-prefill-threshold",
                      str(LOCAL_THRESHOLD), "--transport", "tcp", "--kv-layerwise", "on")
    request.addfinalizer(cluster.stop)
    return cluster


def test_disaggregated_deepseek_matches_the_offline_engine(deepseek_tcp: Cluster) -> None:
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(functools.partial(_complete, deepseek_tcp), prompts()))
    assert [r.choices[0].text for r in results] == list(_offline_texts(deepseek_tcp.model))
    prefill, decode = deepseek_tcp.health(0), deepseek_tcp.health(1)
    for health in (prefill, decode):
        assert health["kv_layout"]["layout"] == LAYOUT_PAGED_MLA
        assert health["kv_layout"]["head_dim"] == 24 + 8  # kv_lora_rank + qk_rope_head_dim
    assert _metric(_scrape(deepseek_tcp.worker_url(1)),
                   'pdserve_transfer_bytes_total{direction="recv"}') > 0
    assert _metric(_scrape(deepseek_tcp.worker_url(0)), "pdserve_kv_layers_streamed_total") > 0
