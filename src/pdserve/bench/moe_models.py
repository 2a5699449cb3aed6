"""Random-weight MoE model folders for `pdserve bench moe`: a DeepSeek-V3 shape and a Qwen3-MoE
shape scaled down to one `MoeBenchShape`, written by transformers' own `save_pretrained` in
bf16 (DeepSeek's router weight and score bias in fp32, as transformers keeps them).

The routed experts are most of each model (64 experts of width 512 at hidden 1024: 100M
parameters a MoE layer against ~3-5M of attention), so a decode step that read every expert
would cost several times one that reads only the chosen ones. Shapes, scaled from the
published configs:
- deepseek_v3 (DeepSeek-V3, arXiv 2412.19437): MLA with q_lora_rank hidden/2, kv_lora_rank
  hidden/4, per-head nope/v 128 and rope 64 (hidden/128 heads); the first layer dense (width
  4 x expert width), the others 1 shared expert plus `num_experts` routed, top-6, sigmoid
  scores with noaux_tc routing over 8 groups (4 kept).
- qwen3_moe (Qwen3-30B-A3B's ratios): GQA, head_dim 128, hidden/64 heads over 1/8 as many KV
  heads, every layer MoE, top-8 softmax routing renormalised, no shared expert.
Weights are transformers' own initialisation under a fixed seed: same shape, same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MOE_MODELS = ("deepseek_v3", "qwen3_moe")
TOP_K = {"deepseek_v3": 6, "qwen3_moe": 8}
_MIN_EXPERTS = max(TOP_K.values())


@dataclass(frozen=True)
class MoeBenchShape:
    hidden_size: int = 1024
    num_experts: int = 64
    expert_width: int = 512  # moe_intermediate_size
    num_layers: int = 4

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.hidden_size % 128:
            raise ValueError(f"hidden size must be a positive multiple of 128 (heads of 128), "
                             f"got {self.hidden_size}")
        if self.num_experts < _MIN_EXPERTS or self.num_experts % 8:
            raise ValueError(f"experts must be a multiple of 8, at least {_MIN_EXPERTS} (top-k), "
                             f"got {self.num_experts}")
        if self.expert_width <= 0:
            raise ValueError(f"expert width must be positive, got {self.expert_width}")
        if self.num_layers < 2:
            raise ValueError(f"layers must be at least 2 (DeepSeek's first is dense), got "
                             f"{self.num_layers}")


def hf_config(model: str, shape: MoeBenchShape, vocab_size: int) -> dict[str, Any]:
    """config.json fields (HF names) of `model` at `shape`."""
    common = {"vocab_size": vocab_size, "hidden_size": shape.hidden_size,
              "num_hidden_layers": shape.num_layers, "num_experts_per_tok": TOP_K[model],
              "moe_intermediate_size": shape.expert_width, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}
    if model == "deepseek_v3":
        groups = 8 if shape.num_experts >= 16 else 1
        return common | {
            "intermediate_size": 4 * shape.expert_width, "n_routed_experts": shape.num_experts,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": groups,
            "topk_group": max(1, groups // 2), "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "num_attention_heads": shape.hidden_size // 128,
            "num_key_value_heads": shape.hidden_size // 128,
            "q_lora_rank": shape.hidden_size // 2, "kv_lora_rank": shape.hidden_size // 4,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "head_dim": 64}
    if model == "qwen3_moe":
        heads = shape.hidden_size // 64
        return common | {
            "intermediate_size": 4 * shape.expert_width, "num_experts": shape.num_experts,
            "norm_topk_prob": True, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 8), "head_dim": 128,
            "use_sliding_window": False, "sliding_window": None, "mlp_only_layers": []}
    raise ValueError(f"unknown MoE bench model {model!r}; choose from {', '.join(MOE_MODELS)}")


def write_moe_model(path: Path, model: str, shape: MoeBenchShape, seed: int = 0) -> Path:
    """Write `model` at `shape` to the folder `path` (created): config.json, bf16 safetensors
    (one tensor per expert, as transformers saves them), the tiny tokenizer. Returns `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.testing.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    fields = hf_config(model, shape, len(tok)) | {
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id}
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model, **fields),
                                          dtype=torch.bfloat16)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(path)
    tok.save_pretrained(path, save_jinja_files=False)
    return path
