"""`pdserve bench engine`'s roofs: the FLOPs it charges a token and the bound it reports."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from pdserve.bench import engine_bench
from pdserve.bench.engine_bench import (
    BenchRow,
    BenchSettings,
    flops_per_token,
    prefill_flops_per_token,
)
from pdserve.cli import main
from pdserve.common.model_config import ModelConfig


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_token_costs_two_flops_per_linear_weight_plus_attention(tiny_model, arch):
    path = tiny_model(arch)
    cfg = ModelConfig.from_folder(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = sum(m.weight.numel() for m in hf.modules() if isinstance(m, nn.Linear))
    assert flops_per_token(cfg, 0) == 2 * weights
    per_position = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T and PV
    assert flops_per_token(cfg, 10) == 2 * weights + 10 * per_position
    head = 2 * cfg.vocab_size * cfg.hidden_size  # a prefill samples once, from its last token
    assert prefill_flops_per_token(cfg, 100) == pytest.approx(
        2 * weights - head + head / 100 + 50 * per_position)
    # 50 computed after 100 cached: each attends to the cached 100 and half of the 50
    assert prefill_flops_per_token(cfg, 50, cached=100) == pytest.approx(
        2 * weights - head + head / 50 + 125 * per_position)


def test_the_bound_is_the_lower_roof():
    memory_bound = BenchRow("decode", 1, 32, 50.0, 25.0, roofline_tok_s=100.0,
                            compute_roof_tok_s=1000.0)
    compute_bound = BenchRow("decode", 32, 32, 500.0, 250.0, roofline_tok_s=3200.0,
                             compute_roof_tok_s=1000.0)
    assert (memory_bound.bound_tok_s, memory_bound.of_bound) == (100.0, 0.5)
    assert (compute_bound.bound_tok_s, compute_bound.of_bound) == (1000.0, 0.5)
    assert compute_bound.of_roofline == pytest.approx(500 / 3200)


def _prefill(tokens: int, tok_s: float, roof: float, cached: int = 0, chunk: int = 0
             ) -> BenchRow:
    return BenchRow("prefill", 1, tokens, tok_s, None, roof, roof, cached, chunk)


def test_longer_prompts_are_set_against_the_thousand_token_rate_and_their_roofs():
    rows = [BenchRow("decode", 8, 32, 400.0, 100.0, 900.0, 700.0), _prefill(512, 1600.0, 1800.0),
            _prefill(1000, 1400.0, 1700.0), _prefill(2048, 1300.0, 1500.0),
            _prefill(8191, 630.0, 850.0), _prefill(2048, 1100.0, 1300.0, cached=1024),
            _prefill(2048, 1200.0, 1500.0, chunk=256)]
    assert engine_bench.length_scaling(rows) == [
        "prefill at 2,048 tokens: 0.93x the rate at 1,000 (the compute roofs: 0.88x)",
        "prefill at 8,191 tokens: 0.45x the rate at 1,000 (the compute roofs: 0.50x)"]
    assert engine_bench.format_table(rows).splitlines()[-1] == engine_bench.length_scaling(rows)[1]
    # no prompt up to 1,000 tokens: the shortest is the reference; one whole prompt: no line
    assert engine_bench.length_scaling(rows[3:5]) == [
        "prefill at 8,191 tokens: 0.48x the rate at 2,048 (the compute roofs: 0.57x)"]
    assert engine_bench.length_scaling(rows[:2] + rows[5:]) == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_lens": ()}, "prompt lengths must be positive"),
    ({"cached_len": 1}, "cached_len must be 0 .* or at least 2"),
    ({"chunk": -1}, "chunk must be 0"),
    ({"cached_len": 0, "chunk": 256}, "positive with a cached_len prompt"),
])
def test_bad_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchSettings(**kwargs)


def test_no_cpu_kernels_reaches_the_benchmark(monkeypatch) -> None:
    """`pdserve bench engine --no-cpu-kernels` runs the engine on PyTorch operators only."""
    seen: list[BenchSettings] = []
    monkeypatch.setattr(engine_bench, "main", lambda s, as_json: seen.append(s) or 0)
    assert main(["bench", "engine", "--model", "tiny", "--no-cpu-kernels"]) == 0
    assert main(["bench", "engine", "--model", "tiny"]) == 0
    assert [s.cpu_kernels for s in seen] == [False, True]
