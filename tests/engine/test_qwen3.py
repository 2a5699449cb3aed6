"""Qwen3 and Qwen3-MoE against transformers, on folders transformers itself wrote, beyond the
logits and greedy tokens of `test_parity.py`: through the prefill -> decode hand-over, which
layers are MoE, and the compiled operators running parts of their layers."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.common.model_config import ModelConfig
from pdserve.engine import kernels
from pdserve.engine.model.qwen3 import SparseMoeBlock
from tests.conftest import engine_pair, hf_greedy
from tests.engine.test_handover import PROMPTS as HANDOVER_PROMPTS
from tests.engine.test_handover import _hand_over, _prefill_all, _run
from tests.engine.test_parity import _engine_logits

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ARCHS = ["qwen3", "qwen3_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_handover_decodes_like_transformers(tiny_model, arch):
    """A prefill engine's KV blocks copied into a decode engine continue as transformers."""
    path = tiny_model(arch)
    pre, dec = engine_pair(path)
    for out in _prefill_all(pre, HANDOVER_PROMPTS, GREEDY).values():
        _hand_over(pre, dec, out, GREEDY)
    final = _run(dec)
    for i, prompt in enumerate(HANDOVER_PROMPTS):
        assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(path, prompt, 24)
    assert dec.block_manager.num_used_blocks == 0


def test_moe_layers_follow_mlp_only_layers(tiny_model):
    """The tiny Qwen3-MoE lists layer 1 in mlp_only_layers: it is dense, 0 and 2 are MoE."""
    llm = LLM(model=str(tiny_model("qwen3_moe")), dtype="float32", max_model_len=256)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in llm.engine.model.layers]
    assert kinds == [True, False, True]


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_operators_do_not_claim_qwen3(tiny_model, arch):
    cfg = ModelConfig.from_folder(tiny_model(arch, head_dim=64))
    assert cfg.qk_norm and not kernels.supports(cfg)


def test_a_bad_moe_field_in_config_json_is_refused(tiny_model):
    path = tiny_model("qwen3_moe", num_experts_per_tok=6)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(6\) must not exceed"):
        ModelConfig.from_folder(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bf16_qwen3_on_the_compiled_operators_is_as_close_to_fp32_as_pytorch_operators(
        tiny_model, ops, arch):
    """Norms, rotary, the KV store and attention on the operators (head size 64 is covered):
    prefill logits no further from fp32 than bf16 on PyTorch's operators, and every greedy
    decode token one that fp32 scores within bf16 rounding of its best."""
    path = tiny_model(arch, head_dim=64)
    on, off = (LLM(model=str(path), dtype="bfloat16", max_model_len=256, cpu_kernels=kernels)
               for kernels in (True, False))
    attn = on.engine.model.layers[0].self_attn
    assert attn.ops is ops and attn.q_norm.fused is ops and on.engine.model.norm.fused is ops
    assert off.engine.model.layers[0].self_attn.ops is None
    fp32 = LLM(model=str(path), dtype="float32", max_model_len=256)
    # summed over prompts: one prompt's error ratio alone swings 0.9-1.3x between the CPUs'
    # linear kernels (an MoE router's near-ties), several prompts' sum stays within 1.1x
    prompts = [list(range(first, first + 40)) for first in (20, 60, 100, 140)]
    errors = [0.0, 0.0]
    for prompt in prompts:
        exact = _engine_logits(fp32, prompt)
        for i, llm in enumerate((on, off)):
            errors[i] += (_engine_logits(llm, prompt).float() - exact).abs().mean().item()
    assert errors[0] <= 1.25 * errors[1], errors
    prompt = prompts[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = on.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    scores = _engine_logits(fp32, prompt + tokens[:-1])[len(prompt) - 1 :]  # [16, vocab]
    chosen = scores.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (scores.max(dim=1).values - chosen).max() < 0.1
