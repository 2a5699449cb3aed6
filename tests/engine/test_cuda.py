"""The engine and the transfer plane on a CUDA GPU (marker `gpu`; skipped where there is none).

The references are the CPU ones of the rest of the suite: transformers in fp32 on the CPU, and
the CPU engine. fp32 on the GPU must give transformers' greedy tokens exactly (PyTorch keeps
TF32 off for fp32 matmuls by default); bf16 must be as close to fp32 as transformers' own bf16
on the same GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.checksum import slices_crc32c
from tests.conftest import engine_pair, hf_greedy, hf_logits
from tests.engine.test_handover import PROMPTS as HANDOVER_PROMPTS
from tests.engine.test_handover import _hand_over, _prefill_all, _run
from tests.engine.test_memory import assert_preempted_requests_keep_their_tokens
from tests.engine.test_parity import GREEDY, PROMPTS, _engine_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), device="cuda", **{"dtype": "float32", "max_model_len": 256, **kw})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    llm = _llm(path)
    assert llm.engine.kv_cache.data.is_cuda
    ours = _engine_logits(llm, list(range(30, 70)))
    assert ours.is_cuda
    torch.testing.assert_close(ours.cpu(), hf_logits(path, list(range(30, 70))),
                               rtol=1e-3, atol=1e-3)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_batch_matches_transformers(tiny_model, chunked):
    path = tiny_model("llama")
    extra = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24} if chunked else {}
    llm = _llm(path, **extra)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 48)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_steps_replay_cuda_graphs_with_the_eager_steps_tokens(tiny_model, arch):
    path = tiny_model(arch)
    graphed = _llm(path, max_num_seqs=6)
    runner = graphed.engine.runner
    assert runner.graphs is not None and runner.graphs.buckets == (1, 2, 4, 6)
    assert runner.kernels is not None  # the Triton kernels passed their check here
    eager = _llm(path, max_num_seqs=6, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    ours = graphed.generate(PROMPTS, GREEDY, use_tqdm=False)
    theirs = eager.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, a, b in zip(PROMPTS, ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(path, prompt, 48)
    assert graphed.engine.block_manager.num_used_blocks == 0


def test_preempted_requests_recompute_to_the_same_tokens(tiny_model):
    path = tiny_model("llama")
    assert_preempted_requests_keep_their_tokens(_llm(path, max_model_len=128, num_kv_blocks=12),
                                                path)


def test_prefix_cache_hits_keep_the_tokens(tiny_model):
    path = tiny_model("llama")
    llm = _llm(path)
    shared = list(range(40, 90))  # three full blocks
    llm.generate([shared + [5, 6]], GREEDY, use_tqdm=False)
    out = llm.generate([shared + [7, 8, 9]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_greedy(path, shared + [7, 8, 9], 48)


def test_seeded_sampling_repeats(tiny_model):
    llm = _llm(tiny_model("llama"))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=24,
                            ignore_eos=True)
    a, b = (llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(tiny_model):
    path = tiny_model("llama")
    prompt = list(range(30, 70))
    ref = hf_logits(path, prompt)  # fp32, CPU
    ours = _engine_logits(_llm(path, dtype="bfloat16"), prompt).float().cpu()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()

    def err(x: torch.Tensor) -> float:
        return ((x - ref).abs().max() / ref.abs().max()).item()

    assert err(ours) <= 1.5 * err(theirs) + 1e-3, (err(ours), err(theirs))


def test_prefill_to_decode_handover_on_the_gpu(tiny_model):
    path = tiny_model("llama")
    pre, dec = engine_pair(path, device="cuda")
    assert pre.kv_cache.data.is_cuda and dec.kv_cache.data.is_cuda
    for out in _prefill_all(pre, HANDOVER_PROMPTS, GREEDY).values():
        _hand_over(pre, dec, out, GREEDY)
    final = _run(dec)
    for i, prompt in enumerate(HANDOVER_PROMPTS):
        assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(path, prompt, 48)
    assert pre.block_manager.num_used_blocks == dec.block_manager.num_used_blocks == 0


def test_checksums_of_a_gpu_pool_are_those_of_its_bytes(tiny_model):
    from pdserve.common.model_config import ModelConfig

    cache = KVCache(ModelConfig.from_folder(tiny_model("llama")), 64, 16, torch.bfloat16, "cuda")
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(3)))
    blocks, layers = [9, 2, 40, 63], range(cache.data.shape[1])
    host = cache.data.cpu().clone()
    assert slices_crc32c(cache.data, blocks, layers) == slices_crc32c(host, blocks, layers)
    cache.data[40, 1].view(torch.uint8).view(-1)[5] ^= 1
    changed = [i for i, (x, y) in enumerate(zip(slices_crc32c(cache.data, blocks, layers),
                                                 slices_crc32c(host, blocks, layers),
                                                 strict=True)) if x != y]
    assert changed == [2 * len(layers) + 1]


def test_nixl_moves_gpu_blocks_byte_for_byte():
    pytest.importorskip("nixl_cu12")
    from tests.transfer.test_nixl import endpoint
    from tests.transfer.test_tcp import BS, MODEL, finish, mapping

    a_pool = KVCache(MODEL, 400, BS, torch.float32, "cuda")
    b_pool = KVCache(MODEL, 400, BS, torch.float32, "cuda")
    for seed, p in enumerate((a_pool, b_pool)):
        p.data.copy_(torch.randn(p.data.shape, generator=torch.Generator().manual_seed(seed)))
    with endpoint(a_pool) as a, endpoint(b_pool) as b:
        src, dst = mapping(300, seed=3)
        assert finish(a, a.write(5, src, b.local, dst), b) == "done"
        torch.cuda.synchronize()
        assert torch.equal(b_pool.data[dst], a_pool.data[src])
        back = mapping(7, seed=4)
        assert finish(a, a.read(6, back[0], b.local, back[1]), b) == "done"
        torch.cuda.synchronize()
        assert torch.equal(a_pool.data[back[0]], b_pool.data[back[1]])
