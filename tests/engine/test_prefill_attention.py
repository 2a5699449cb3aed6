"""The compiled prefill attention (csrc/prefill_attention_amx.cpp on AMX,
prefill_attention.cpp on AVX512-BF16, prefill_attention_fma.cpp on AVX2): causal flash
attention over the paged pool, read in place. As close to fp32 as PyTorch's bf16 SDPA; a
position's output the same bits however the prompt is chunked, whatever was cached; and an
engine that chunks its prompts (pacing) or serves them from the prefix cache samples from the
same logits as one that computes them whole."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from tests.conftest import KV_BLOCKS
from tests.engine.test_cpu_kernels import KERNEL_SHAPE, _logits_by_request

BF16 = torch.bfloat16


def _case(gen, n: int, start: int, heads: int, kvh: int, d: int, bs: int = 16):
    """q as the model gives it (strided rows of qkv), and a pool of the engine's layout whose
    table scatters the context over random blocks; block 0, never in the table, holds NaN
    (a free block may hold anything)."""
    length = start + n
    used = -(-length // bs)
    data = torch.randn(used + 6, 3, 2, bs, kvh, d, generator=gen).to(BF16)
    data[0] = float("nan")
    k_cache, v_cache = data[:, 1, 0], data[:, 1, 1]
    table = torch.randperm(used + 5, generator=gen)[:used] + 1
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=gen).to(BF16)
    return qkv[:, : heads * d].view(n, heads, d), k_cache, v_cache, table, length


def _sdpa(q, k_cache, v_cache, table, length, dtype):
    """PyTorch's SDPA in `dtype` over the gathered context, causal at the query offset."""
    k = k_cache.index_select(0, table).flatten(0, 1)[:length].to(dtype)
    v = v_cache.index_select(0, table).flatten(0, 1)[:length].to(dtype)
    n = q.shape[0]
    mask = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1).float()


@pytest.mark.parametrize(("n", "start", "heads", "kvh", "d"), [
    (2, 0, 9, 3, 64),       # SmolLM2's heads; under one tile
    (200, 0, 9, 3, 64),     # several tiles, the last one partial
    (37, 500, 9, 3, 64),    # a chunk after a long cached context
    (64, 64, 4, 4, 128),    # tiles exactly; D = 128, no grouping
    (130, 33, 32, 8, 128),  # 4 query heads per KV head; unaligned start
    (90, 0, 8, 1, 64),      # 8 query heads per KV head
    (2048, 0, 9, 3, 64),    # a long prompt
    (1024, 1024, 9, 3, 64),  # its second half over a cached first half
])
def test_it_is_as_close_to_fp32_as_bf16_sdpa(prefill_kernel, n, start, heads, kvh, d):
    gen = torch.Generator().manual_seed(n + start)
    q, k_cache, v_cache, table, length = _case(gen, n, start, heads, kvh, d)
    got = prefill_kernel(q, k_cache, v_cache, table, length, d**-0.5).float()
    want = _sdpa(q, k_cache, v_cache, table, length, torch.float32)
    sdpa_error = (_sdpa(q, k_cache, v_cache, table, length, BF16) - want).abs().max()
    assert not got.isnan().any()  # the NaN block is never read
    assert (got - want).abs().max() <= 1.5 * sdpa_error + 1e-3


@pytest.mark.parametrize("factor", [10.0, 4.0, 2.5])
def test_a_maximum_that_jumps_late_in_a_row_rescales_what_came_before(prefill_kernel, factor):
    """Keys far into the context that score `factor` x the others: at 10x each row's running
    maximum jumps by far more than e^8 after hundreds of keys (what an online softmax must
    rescale, and what a lazily moved maximum must not miss); at 2.5-4x many rows' maxima rise
    by less than the slack, where the weights taken against the old maximum stand."""
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, table, length = _case(gen, 300, 500, 9, 3, 64)
    for pos in (130, 620, 790):
        k_cache[table[pos // 16], pos % 16] *= factor
    got = prefill_kernel(q, k_cache, v_cache, table, length, 0.125).float()
    want = _sdpa(q, k_cache, v_cache, table, length, torch.float32)
    sdpa_error = (_sdpa(q, k_cache, v_cache, table, length, BF16) - want).abs().max()
    assert (got - want).abs().max() <= 1.5 * sdpa_error + 1e-3


def test_a_position_gives_the_same_bits_in_any_chunk(prefill_kernel):
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, table, length = _case(gen, 300, 0, 9, 3, 64)
    whole = prefill_kernel(q, k_cache, v_cache, table, length, 0.125)
    for cuts in ([0, 77, 200, 300], [0, 1, 64, 65, 299, 300], [0, 150, 300]):
        parts = [prefill_kernel(q[a:b], k_cache, v_cache, table, b, 0.125)
                 for a, b in itertools.pairwise(cuts)]
        assert torch.equal(torch.cat(parts), whole), cuts


def test_prefill_attention_runs_the_fastest_kernel_of_this_cpu(flash):
    name = flash.prefill_attention_kernel()
    assert name == ("amx" if flash.amx_available()
                    else "avx512_bf16" if flash.dpbf16_available() else "avx2")
    kernel = {"amx": flash.prefill_attention_amx, "avx512_bf16": flash.prefill_attention_dpbf16,
              "avx2": flash.prefill_attention_fma}[name]
    q, k_cache, v_cache, table, length = _case(torch.Generator().manual_seed(5), 70, 30, 9, 3,
                                               64)
    assert torch.equal(flash.prefill_attention(q, k_cache, v_cache, table, length, 0.125),
                       kernel(q, k_cache, v_cache, table, length, 0.125))


def test_it_refuses_what_it_cannot_read(prefill_kernel):
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, table, length = _case(gen, 20, 0, 9, 3, 64)
    with pytest.raises(RuntimeError, match="context_len 10 < 20 query rows"):
        prefill_kernel(q, k_cache, v_cache, table, 10, 0.125)
    with pytest.raises(RuntimeError, match="block_table must be contiguous int64 covering"):
        prefill_kernel(q, k_cache, v_cache, table, 100, 0.125)
    bad = table.clone()
    bad[1] = 1000
    with pytest.raises(RuntimeError, match="block id 1000 is outside the pool"):
        prefill_kernel(q, k_cache, v_cache, bad, length, 0.125)
    with pytest.raises(RuntimeError, match="multiples of 64, not 32"):
        prefill_kernel(*_case(gen, 20, 0, 9, 3, 32), 0.125)
    with pytest.raises(RuntimeError, match="q must be bf16"):
        prefill_kernel(q.float(), k_cache, v_cache, table, length, 0.125)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = [(t * 13) % 480 + 5 for t in range(150)]
STREAM = list(range(5, 25))


def _long_beside_a_stream(llm: LLM, chunk: int | None) -> list[torch.Tensor]:
    """The long prompt's sampled logits, computed while a short request decodes."""
    engine = llm.engine
    engine.set_prefill_chunk(chunk)
    seen = _logits_by_request(llm)
    engine.add_request(STREAM, GREEDY, request_id="stream")
    engine.step()
    engine.add_request(LONG, GREEDY, request_id="long")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return seen["long"]


def test_a_bf16_engine_samples_the_same_logits_chunked_or_whole(tiny_model):
    path = str(tiny_model("llama", **KERNEL_SHAPE))

    def llm() -> LLM:
        return LLM(model=path, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False,
                   num_kv_blocks=KV_BLOCKS)

    whole = _long_beside_a_stream(llm(), None)
    chunked = _long_beside_a_stream(llm(), 32)  # 5 chunks, each beside a decode
    assert llm().engine.model.fused is not None
    assert len(whole) == len(chunked) == GREEDY.max_tokens
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)


def test_a_bf16_prefix_cache_hit_samples_the_same_logits_as_a_miss(tiny_model):
    llm = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16",
              max_model_len=256, enable_prefix_caching=True, num_kv_blocks=KV_BLOCKS)
    seen = _logits_by_request(llm)
    (first,) = llm.generate([LONG], GREEDY, use_tqdm=False)
    (again,) = llm.generate([LONG], GREEDY, use_tqdm=False)
    assert llm.engine.block_manager.num_used_blocks == 0
    # the second found the first's full blocks cached and computed only the rest
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 144
    for a, b in zip(seen[first.request_id], seen[again.request_id], strict=True):
        assert torch.equal(a, b)


def test_a_bf16_prompt_samples_the_same_logits_alone_or_batched(tiny_model):
    path = str(tiny_model("llama", **KERNEL_SHAPE))
    logits = {}
    for batch in ([LONG], [STREAM * 4, LONG, LONG[:70]]):
        llm = LLM(model=path, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False,
                  num_kv_blocks=KV_BLOCKS)
        seen = _logits_by_request(llm)
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        logits[len(batch)] = seen[outs[batch.index(LONG)].request_id]
    assert len(logits[1]) == len(logits[3]) == GREEDY.max_tokens
    for a, b in zip(logits[1], logits[3], strict=True):
        assert torch.equal(a, b)
