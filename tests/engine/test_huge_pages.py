"""Huge-page CPU tensors for the packed weights and the KV pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine import huge_pages
from pdserve.engine.kv_cache import KVCache


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_zeros_is_a_zeroed_writable_tensor_on_a_huge_page_boundary():
    t = huge_pages.zeros((3, 5, 1000), torch.bfloat16)
    assert t.shape == (3, 5, 1000) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t[1, 2, 3] = 7
    assert t.sum() == 7
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert huge_pages.zeros((0, 4), torch.float32).shape == (0, 4)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="THP is off here")
def test_the_cpu_kv_pool_sits_on_huge_pages():
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=256)
    cache = KVCache(cfg, num_blocks=512, block_size=16, dtype=torch.bfloat16)  # 8 MiB
    assert cache.data.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _anon_huge_kib(cache.data.data_ptr()) >= 4096  # most of it, in 2 MiB pages
    view = cache.data
    del cache
    assert torch.count_nonzero(view) == 0  # the mapping outlives the cache object
