"""`pdserve up --device cuda` (marker `gpu`; skipped where there is none): the concurrent greedy
batch of test_serving.py gives the CPU engine's texts, collocated and disaggregated over NIXL
with the KV in GPU memory (streamed layer by layer: `--kv-layerwise auto` is on for CUDA)."""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import LENGTHS, _complete, _offline_texts, prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=["collocated", "disagg_nixl"])
def cuda_cluster(request, tiny_model) -> tuple[Cluster, int]:
    """The cluster and its number of workers."""
    args = ("--collocated", "1") if request.param == "collocated" else ("--transport", "nixl")
    if request.param == "disagg_nixl":
        pytest.importorskip("nixl_cu12")
    cluster = Cluster(tiny_model(), "--device", "cuda", "--local-prefill-threshold",
                      str(LOCAL_THRESHOLD), *args)
    request.addfinalizer(cluster.stop)
    return cluster, 1 if request.param == "collocated" else 2


def test_concurrent_greedy_batch_matches_the_cpu_engine(cuda_cluster) -> None:
    cluster, num_workers = cuda_cluster
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(functools.partial(_complete, cluster), prompts()))
    assert [r.choices[0].text for r in results] == list(_offline_texts(cluster.model))
    workers = [cluster.worker_url(i) for i in range(num_workers)]
    if num_workers == 2:  # the long prompts' KV crossed from prefill (0) to decode (1)
        assert metric(workers[1], "pdserve_kv_recomputes_total") == 0
        assert metric(workers[0], "pdserve_kv_layers_streamed_total") > 0
    deadline = time.monotonic() + 15
    while any(metric(w, "pdserve_kv_blocks_used") for w in workers):
        assert time.monotonic() < deadline, "KV blocks were not returned"
        time.sleep(0.1)
