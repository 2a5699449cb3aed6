"""Qwen3 and Qwen3-MoE against transformers, on folders transformers itself wrote, beyond the
logits and greedy tokens of `test_parity.py`: through the prefill -> decode hand-over, which
layers are MoE, and the compiled operators leaving them alone."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.common.model_config import ModelConfig
from pdserve.engine import kernels
from pdserve.engine.model.qwen3 import SparseMoeBlock
from tests.conftest import engine_pair, hf_greedy
from tests.engine.test_handover import PROMPTS as HANDOVER_PROMPTS
from tests.engine.test_handover import _hand_over, _prefill_all, _run

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
