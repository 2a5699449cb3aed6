"""The paged attention kernels of the GPU (`triton_paged`), against PyTorch's SDPA over the
same blocks gathered. On a CPU they run in Triton's interpreter (the conftest sets
TRITON_INTERPRET where no GPU is seen); with a GPU, compiled for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model import triton_paged
from pdserve.engine.model.attention import DecodeGroup, _decode, _gather

pytest.importorskip("triton", reason="the paged kernels are written in Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter
SHAPES = [(4, 2, 16, 16), (9, 3, 64, 16), (6, 1, 24, 8), (5, 5, 32, 4)]


def _pool(kv_heads: int, head_dim: int, block_size: int, blocks: int, dtype: torch.dtype):
    """K and V views of one layer of a 3-layer pool (strided, as the engine's)."""
    pool = torch.randn(blocks, 3, 2, block_size, kv_heads, head_dim).to(dtype)
    return pool[:, 1, 0], pool[:, 1, 1]


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of each output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_decode_reads_blocks_in_place_as_sdpa_reads_them_gathered(
        dtype, heads, kv_heads, head_dim, block_size) -> None:
    torch.manual_seed(0)
    lens = torch.tensor([1, 7, 33, block_size, 100, 2 * block_size + 1])
    width = -(-int(lens.max()) // block_size)
    k_cache, v_cache = _pool(kv_heads, head_dim, block_size, len(lens) * width + 5, dtype)
    tables = torch.randperm(k_cache.shape[0])[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref = _decode(q, k_cache, v_cache, DecodeGroup(0, tables.reshape(-1), lens, block_size), scale)
    out = triton_paged.decode_attention(*_on_device(q, k_cache, v_cache, tables, lens),
                                        scale).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(dtype), rtol=_tol(dtype))

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize(("new", "context"), [(21, 40), (100, 130), (70, 70), (1, 33)])
def test_prefill_over_a_cached_prefix_is_sdpa_over_it_gathered(
        dtype, heads, kv_heads, head_dim, block_size, new, context) -> None:
    """`new` queries after context - new positions in the pool (none: a whole prompt; one: the
    last token of a prompt cached but for it), over blocks in a scattered order."""
    torch.manual_seed(0)
    used = -(-context // block_size)
    k_cache, v_cache = _pool(kv_heads, head_dim, block_size, used + 3, dtype)
    block_ids = torch.randperm(used + 3)[:used]
    q = torch.randn(new, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    k, v = (_gather(c, block_ids, context).float() for c in (k_cache, v_cache))
    causal = (torch.arange(context)[None, :]
              <= torch.arange(context - new, context)[:, None])  # [new, context]
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=causal, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    out = triton_paged.prefill_attention(*_on_device(q, k_cache, v_cache, block_ids), context,
                                         scale).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


def test_the_kernels_refuse_shapes_that_do_not_fit() -> None:
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(8, 16, 3, 16)  # 3 KV heads do not divide 4 query heads
    with pytest.raises(ValueError, match="shapes do not fit"):
        triton_paged.decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                      torch.ones(2, dtype=torch.long), 0.25)
    with pytest.raises(ValueError, match="shapes do not fit"):
        triton_paged.prefill_attention(q, cache, cache, torch.zeros(1, dtype=torch.long), 2,
                                       0.25)
    cache = torch.zeros(8, 16, 2, 16)
    with pytest.raises(ValueError, match="a context of 40 and 2 blocks of 16 do not fit"):
        triton_paged.prefill_attention(q, cache, cache, torch.zeros(2, dtype=torch.long), 40,
                                       0.25)




def test_the_kernels_check_themselves_against_attention_written_out(monkeypatch) -> None:
    triton_paged.self_check(DEVICE, torch.float32)
    triton_paged.self_check(DEVICE, torch.bfloat16)
    for name in ("decode", "prefill"):
        with monkeypatch.context() as m:
            m.setattr(triton_paged, f"{name}_attention", lambda q, *rest: torch.zeros_like(q))
            with pytest.raises(RuntimeError, match=f"the {name} kernel's output differs"):
                triton_paged.self_check(DEVICE, torch.float32)
