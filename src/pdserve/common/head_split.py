"""Which tensor-parallel sizes split a model's attention heads (torch-free: the engine's shard
plan and `pdserve k8s render` ask the same question).

With at least as many KV heads as ranks, each rank takes a contiguous run of whole KV heads
with their query heads; the runs may differ by one head (SmolLM2's 3 KV heads on 2 ranks: 1
and 2). With fewer KV heads than ranks, each KV head is replicated on size / kv_heads ranks
(vLLM's rule), which must split its query heads evenly.
"""

from __future__ import annotations


def head_split_error(size: int, heads: int, kv_heads: int) -> str | None:
    """Why `size` ranks cannot split `heads` query heads over `kv_heads` KV heads; None if
    they can."""
    if size <= kv_heads:
        return None
    group = heads // kv_heads  # query heads per KV head
    if size % kv_heads or group % (size // kv_heads):
        return (f"tensor-parallel size {size} does not split {heads} attention heads over "
                f"{kv_heads} KV heads: with fewer KV heads than ranks each KV head is "
                f"replicated on size / {kv_heads} ranks, so the size must be a multiple of "
                f"{kv_heads} whose replicas split each KV head's {group} query heads evenly; "
                f"choose a size of at most {kv_heads}, or such a multiple")
    return None
