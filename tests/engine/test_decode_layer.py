"""The C++ decoder layer of decode-only steps (`decode_layer`) against the same layer run
through Python, operator by operator: the same logits, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model.llama import DecoderLayer, LlamaForCausalLM
from pdserve.engine.model.packed_linear import linear_kernel
from tests.conftest import KV_BLOCKS
from tests.engine.test_cpu_kernels import KERNEL_SHAPE, _logits_by_request


def _run(path, prompts, params):
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=512, num_kv_blocks=KV_BLOCKS)
    logits = _logits_by_request(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_manager.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a bias on the q|k|v projection
def test_decode_steps_through_the_cpp_layer_give_the_python_layers_logits(
        ops, tiny_model, monkeypatch, arch):
    if linear_kernel(ops) is None:
        pytest.skip("this CPU has no linear kernel of pdserve's: the layers stay in Python")
    path = tiny_model(arch, **KERNEL_SHAPE)
    # the 300-token prompt's context is over twice the others' and over 256 tokens: a second
    # decode group
    prompts = [[7], list(range(5, 12)), list(range(20, 320))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = []
    fused_decode = DecoderLayer.fused_decode

    def counted(self, *args):
        calls.append(args[2])
        return fused_decode(self, *args)

    monkeypatch.setattr(DecoderLayer, "fused_decode", counted)
    tokens, logits = _run(path, prompts, params)
    assert calls, "decode steps did not take the C++ layer"
    assert max(len(step.tables) for step in calls) == 2
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode_step", lambda self, p, m: None)
    python_tokens, python_logits = _run(path, prompts, params)
    assert tokens == python_tokens
    for ours, theirs in zip(logits, python_logits, strict=True):
        assert len(ours) == params.max_tokens
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_step_with_a_prefill_or_a_linear_on_onednn_stays_in_python(ops, tiny_model):
    llm = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16",
              max_model_len=64, cpu_kernels=False, num_kv_blocks=KV_BLOCKS)
    assert llm.engine.model._layer_kernel is None  # PyTorch operators, oneDNN linears
    model = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16",
                max_model_len=64, num_kv_blocks=KV_BLOCKS).engine.model
    assert model._layer_kernel == (None if linear_kernel(ops) is None else linear_kernel(ops).name)
