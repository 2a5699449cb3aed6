"""DeepSeek-V2/V3 (Multi-head Latent Attention over the latent pool) against transformers:
prefill logits to fp32 rounding, greedy tokens exactly through prefill (expanded latents) and
many decode steps (absorbed attention), a cached prefix, chunked prefill and the hand-over."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.common.model_config import ModelConfig
from pdserve.engine import kernels
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model.mla_attention import absorbed_dtype
from pdserve.engine.model.packed_linear import onednn_packs
from pdserve.planner.kv_math import kv_bytes_per_token
from pdserve.planner.model_shape import load_model_shape
from pdserve.router.split_decision import kv_bytes_per_token as layout_bytes_per_token
from pdserve.transfer.layout import LAYOUT_PAGED_MLA, KVLayout
from tests.conftest import engine_pair, hf_greedy, hf_logits
from tests.engine.test_handover import _hand_over, _prefill_all, _run
from tests.engine.test_parity import _engine_logits

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# 1 token, shorter than a block, several blocks, exactly one block
PROMPTS = [[7], [5, 6, 7, 8, 9, 10, 11], list(range(20, 77)), list(range(100, 116))]
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.7, "mscale_all_dim": 1.0}
VARIANTS = {
    "v3": ("deepseek_v3", {}),  # q_lora_rank, layer 1 MoE (sigmoid, grouped routing)
    "v2": ("deepseek_v2", {}),  # plain q_proj, layer 1 MoE (softmax, greedy routing)
    "v3-dense-yarn": ("deepseek_v3", {"first_k_dense_replace": 2, "rope_scaling": YARN}),
    "v2-yarn": ("deepseek_v2", {"rope_scaling": YARN}),
}


def _path(tiny_model, variant: str):
    arch, overrides = VARIANTS[variant]
    return tiny_model(arch, **overrides)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny_model, variant):
    path = _path(tiny_model, variant)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    prompt = list(range(30, 70))
    torch.testing.assert_close(_engine_logits(llm, prompt), hf_logits(path, prompt),
                               rtol=1e-4, atol=1e-4)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_batch_matches_transformers(tiny_model, variant):
    path = _path(tiny_model, variant)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 40)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_matches_transformers(tiny_model):
    """A 24-token budget puts the long prompts through several chunks, each expanding the
    latents of the chunks before it from the pool, beside absorbed decodes."""
    path = _path(tiny_model, "v3")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256,
              enable_chunked_prefill=True, max_num_batched_tokens=24)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 40)


def test_prefix_cache_hits_keep_greedy_output(tiny_model):
    path = _path(tiny_model, "v2")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, block_size=16)
    shared = list(range(40, 90))  # 50 tokens: three full blocks to share
    assert llm.generate([shared + [5, 6]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    prompts = [shared + [7, 8, 9], shared[:33]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [48, 32]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 40)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_handover_of_the_latent_pool_matches_transformers(tiny_model):
    path = _path(tiny_model, "v3")
    pre, dec = engine_pair(path)
    assert pre.kv_cache.data.shape[2:] == (1, 16, 1, 24 + 8)
    for out in _prefill_all(pre, PROMPTS, GREEDY).values():
        _hand_over(pre, dec, out, GREEDY)
    final = _run(dec)
    for i, prompt in enumerate(PROMPTS):
        assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(path, prompt, 40)
    assert dec.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_latent_pool_bytes_per_token_equal_the_planners(tiny_model, variant):
    """layers x (kv_lora_rank + qk_rope_head_dim) x 4 bytes: 2 x 32 x 4 = 256, not the
    2 x layers x heads x head_dim x 4 = 960 of a per-head K/V pool."""
    path = _path(tiny_model, variant)
    planner = kv_bytes_per_token(load_model_shape(str(path)), "fp32")
    cfg = ModelConfig.from_folder(path)
    assert planner == cfg.kv_bytes_per_token(4) == 256
    assert KVCache.bytes_per_block(cfg, 16, torch.float32) == 16 * planner
    cache = KVCache(cfg, num_blocks=4, block_size=16, dtype=torch.float32)
    assert cache.block_nbytes == 16 * planner
    layout = KVLayout.of_cache(cache, "tiny")
    assert layout.layout == LAYOUT_PAGED_MLA
    assert layout.bytes_per_token == layout_bytes_per_token(layout.to_json()) == planner


def test_mla_models_take_the_operators_for_parts_of_their_layers(tiny_model):
    """No whole-layer fusion for MLA; on the operators the absorbed weights stay bf16 (the
    decode operator widens them as it reads), else they are in `absorbed_dtype`: fp32 where
    PyTorch would emulate bf16 matmuls (no oneDNN path)."""
    cfg = ModelConfig.from_folder(_path(tiny_model, "v3"))
    assert not kernels.supports(cfg)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    native = torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32
    assert absorbed_dtype(torch.zeros(1, dtype=torch.float32)) == torch.float32
    for cpu_kernels, dtype in ((True, torch.bfloat16), (False, native)):
        llm = LLM(model=str(_path(tiny_model, "v3")), dtype="bfloat16", max_model_len=256,
                  cpu_kernels=cpu_kernels)
        assert llm.engine.model.fused is None
        attn = llm.engine.model.layers[0].self_attn
        assert attn.w_uk.dtype == attn.w_uv.dtype == dtype
        out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["operators", "pytorch"])
@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_a_bf16_mla_model_decodes_tokens_fp32_scores_as_its_best(tiny_model, variant,
                                                                  cpu_kernels):
    """bf16 through the absorbed decode (the operators' `mla_decode`, or on PyTorch fp32
    matmuls where its bf16 ones are emulated): every greedy token is one the fp32 model scores
    within bf16 rounding of its best, teacher-forced on the same tokens."""
    path = str(_path(tiny_model, variant))
    bf16 = LLM(model=path, dtype="bfloat16", max_model_len=256, cpu_kernels=cpu_kernels)
    fp32 = LLM(model=path, dtype="float32", max_model_len=256)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = bf16.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    scores = _engine_logits(fp32, prompt + tokens[:-1])[len(prompt) - 1 :]  # [16, vocab]
    chosen = scores.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (scores.max(dim=1).values - chosen).max() < 0.1
