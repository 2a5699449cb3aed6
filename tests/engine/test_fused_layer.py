"""The C++ decoder layer (`fused_layer`) against the same layer run through Python, operator
by operator: the same logits, bit for bit, in decode-only steps and in steps with prompts
(whole, chunked, beside decode streams)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model.llama import DecoderLayer, LlamaForCausalLM
from pdserve.engine.model.packed_linear import linear_kernel
from tests.conftest import KV_BLOCKS
from tests.engine.test_cpu_kernels import KERNEL_SHAPE, _logits_by_request


def _run(path, prompts, params, **engine):
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=512, num_kv_blocks=KV_BLOCKS,
              **engine)
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
    calls = _count_calls(monkeypatch)
    tokens, logits = _run(path, prompts, params)
    assert calls, "decode steps did not take the C++ layer"
    assert max(len(step.tables) for step in calls) == 2
    _same_as_python(monkeypatch, path, prompts, params, tokens, logits)


@pytest.mark.parametrize("chunk", [None, 48])
def test_steps_with_prompts_through_the_cpp_layer_give_the_python_layers_logits(
        ops, tiny_model, monkeypatch, chunk):
    """Whole prompts sharing a step, or prompts in chunks of 48 tokens beside decoding
    streams (mixed steps: prompt rows first, then the decode groups)."""
    if linear_kernel(ops) is None or not ops.prefill_attention_available():
        pytest.skip("this CPU has no linear kernel or prefill attention of pdserve's")
    path = tiny_model("llama", **KERNEL_SHAPE)
    prompts = [list(range(5, 12)), list(range(20, 220)), list(range(300, 431)), [9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = {} if chunk is None else {"enable_chunked_prefill": True,
                                       "max_num_batched_tokens": chunk}
    calls = _count_calls(monkeypatch)
    tokens, logits = _run(path, prompts, params, **engine)
    with_prompts = [step for step in calls if step.prompt_tokens]
    assert with_prompts, "no step with a prompt took the C++ layer"
    if chunk is not None:
        assert any(step.tables for step in with_prompts), "no mixed step"
        assert max(sum(step.prompt_tokens) + sum(len(x) for x in step.lens)
                   for step in with_prompts) <= chunk
    _same_as_python(monkeypatch, path, prompts, params, tokens, logits, **engine)


def _count_calls(monkeypatch) -> list:
    """The LayerStep of every C++ layer call from now on."""
    calls = []
    fused_forward = DecoderLayer.fused_forward

    def counted(self, *args):
        calls.append(args[2])
        return fused_forward(self, *args)

    monkeypatch.setattr(DecoderLayer, "fused_forward", counted)
    return calls


def _same_as_python(monkeypatch, path, prompts, params, tokens, logits, **engine) -> None:
    monkeypatch.setattr(LlamaForCausalLM, "_fused_step", lambda self, p, m: None)
    python_tokens, python_logits = _run(path, prompts, params, **engine)
    assert tokens == python_tokens
    for ours, theirs in zip(logits, python_logits, strict=True):
        assert len(ours) == params.max_tokens
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_linear_on_onednn_keeps_the_layers_in_python(ops, tiny_model):
    llm = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16",
              max_model_len=64, cpu_kernels=False, num_kv_blocks=KV_BLOCKS)
    assert llm.engine.model._layer_kernel is None  # PyTorch operators, oneDNN linears
    model = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16",
                max_model_len=64, num_kv_blocks=KV_BLOCKS).engine.model
    assert model._layer_kernel == (None if linear_kernel(ops) is None else linear_kernel(ops).name)
