"""The engine against transformers: logits to fp32 rounding, greedy tokens exactly."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from tests.conftest import KV_BLOCKS, hf_greedy, hf_logits

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
# Prompts of different lengths: 1 token, shorter than a block, several blocks, one exact block.
PROMPTS = [[7], [5, 6, 7, 8, 9, 10, 11], list(range(20, 77)), list(range(100, 116))]


def _engine_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill step of the engine: [len, vocab]."""
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
    req = engine.requests[rid]
    engine.scheduler.waiting.remove(req)
    engine.block_manager.allocate(req, use_prefix_cache=False)
    batch = SchedulerOutput()
    batch.add(req, len(prompt))
    inputs = engine.runner.prepare(batch)
    hidden = engine.model(inputs.input_ids, inputs.positions, engine.kv_cache, inputs.meta)
    engine.block_manager.free(req)
    del engine.requests[rid]
    return engine.model.compute_logits(hidden)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama3-rope", "qwen3",
                                  "qwen3_moe"])
def test_logits_match_transformers(tiny_model, arch):
    path = (tiny_model("llama", rope_scaling=LLAMA3_ROPE) if arch == "llama3-rope"
            else tiny_model(arch))
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    prompt = list(range(30, 70))
    ours = _engine_logits(llm, prompt)
    ref = hf_logits(path, prompt)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_batch_matches_transformers(tiny_model, arch, chunked):
    path = tiny_model(arch)
    # A 24-token budget forces every long prompt through several chunks, mixed with decodes.
    extra = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24} if chunked else {}
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256,
              **extra)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 48)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_keep_greedy_output(tiny_model):
    path = tiny_model("llama")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256,
              block_size=16)
    shared = list(range(40, 90))  # 50 tokens: three full blocks to share
    first = llm.generate([shared + [5, 6]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    prompts = [shared + [7, 8, 9], shared + [10], shared[:33]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [48, 48, 32]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 48)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_generated_blocks_are_cached_for_the_next_turn(tiny_model):
    path = tiny_model("llama")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    prompt = list(range(40, 60))
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    turn2 = prompt + out.outputs[0].token_ids + [9, 10]
    again = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(turn2) - 1) // 16 * 16
    assert again.outputs[0].token_ids == hf_greedy(path, turn2, 48)


def test_exact_block_prompt_recomputes_its_last_token(tiny_model):
    """A prompt fully in the cache still computes its last token, to get logits."""
    path = tiny_model("llama")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    prompt = list(range(200, 232))  # exactly two blocks
    a, b = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert b.num_cached_tokens == 16
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(path, prompt, 48)


def test_decodes_of_very_different_contexts_attend_in_groups_and_match_transformers(tiny_model):
    """A long context beside short ones is attended in its own decode group (no padding of the
    short ones to its length), with the tokens unchanged."""
    path = tiny_model("llama", max_position_embeddings=2048)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=2048)
    runner = llm.engine.runner
    seen: list[list[int]] = []
    make_groups = runner._decode_groups

    def spy(reqs, first_row):
        groups = make_groups(reqs, first_row)
        seen.append([g.mask.shape[0] for g in groups])
        return groups

    runner._decode_groups = spy
    gen = torch.Generator().manual_seed(5)
    lengths = (9, 40, 300, 700, 1500)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in lengths]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 16)
    # contexts 9-40 share a group; 300, 700 and 1500 are each over twice the one before
    assert [2, 1, 1, 1] in seen
