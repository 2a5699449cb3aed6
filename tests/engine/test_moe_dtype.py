"""A bf16 DeepSeek model keeps its routers' weight and score bias in fp32, bit for bit the
checkpoint's values, as transformers does (`_keep_in_fp32_modules_strict`); everything else
is bf16."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pdserve.common.model_config import ModelConfig
from pdserve.engine.model.loader import load_model


@pytest.mark.parametrize(("arch", "kept"), [
    ("deepseek_v3", ("weight", "e_score_correction_bias")), ("deepseek_v2", ("weight",))])
def test_a_bf16_deepseek_routes_on_the_checkpoints_fp32_router(tiny_model, arch, kept):
    path = tiny_model(arch)
    saved = load_file(str(path / "model.safetensors"))
    model = load_model(path, ModelConfig.from_folder(path), torch.bfloat16, "cpu", 256)
    gate = model.layers[1].mlp.gate  # layer 1 is the MoE layer
    for name in kept:
        stored = saved[f"model.layers.1.mlp.gate.{name}"]
        assert not torch.equal(stored.bfloat16().float(), stored)  # a cast would show
        tensor = getattr(gate, name)
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, stored)
    assert model.layers[1].input_layernorm.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_qwen3_moe_router_follows_the_model_dtype(tiny_model):
    """transformers keeps Qwen3-MoE's router in the model's dtype; so does pdserve: bf16
    logits from the checkpoint's weight (a linear layer, packed or not as this CPU allows)."""
    path = tiny_model("qwen3_moe")
    saved = load_file(str(path / "model.safetensors"))["model.layers.0.mlp.gate.weight"]
    cfg = ModelConfig.from_folder(path)
    model = load_model(path, cfg, torch.bfloat16, "cpu", 256)
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits = model.layers[0].mlp.gate(x)
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, saved.shape[0])
    expected = torch.nn.functional.linear(x.float(), saved.bfloat16().float())
    torch.testing.assert_close(logits.float(), expected, rtol=2**-7, atol=1e-3)
