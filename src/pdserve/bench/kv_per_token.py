"""KV bytes a token costs in a DeepSeek-V3-shaped model's latent pool against a same-width GQA
model, as the engine's own pools hold them (the bytes `pdserve bench transfer` moves per token).

The GQA twin keeps the DeepSeek model's hidden size, layers and heads, with a quarter as many
KV heads (a common GQA ratio: Llama-3.1-8B 32/8) of the MLA model's q.k head width
(`ModelConfig.head_dim`: qk_nope + qk_rope). Each figure is one token's share of a built
`KVCache` block (`block_nbytes / block_size`), checked equal to `KVCache.bytes_per_block` and to
the planner's `kv_math.kv_bytes_per_token`. No weights: configs and one-block pools only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.bench.moe_models import MoeBenchShape, hf_config
from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.planner.kv_math import kv_bytes_per_token
from pdserve.planner.model_shape import PRESETS, shape_from_config

BLOCK_SIZE = 16
GQA_RATIO = 4  # query heads per KV head of the GQA twin


@dataclass(frozen=True)
class KvPerTokenRow:
    model: str
    layers: int
    heads: int
    mla_bytes: int  # one token of the latent pool, every layer, bf16
    gqa_kv_heads: int
    gqa_head_dim: int
    gqa_bytes: int  # one token of the GQA twin's K/V pool, every layer, bf16

    @property
    def ratio(self) -> float:
        return self.mla_bytes / self.gqa_bytes


def _deepseek_configs() -> dict[str, dict[str, Any]]:
    """The published DeepSeek-V3 config (the planner's preset) and `pdserve bench moe`'s."""
    bench = hf_config("deepseek_v3", MoeBenchShape(), vocab_size=512)
    return {"deepseek-v3": PRESETS["deepseek-v3"],
            "bench-moe deepseek_v3": bench | {"model_type": "deepseek_v3"}}


def _gqa_twin(mla: dict[str, Any], head_dim: int) -> dict[str, Any]:
    heads = mla["num_attention_heads"]
    return {"model_type": "llama", "num_hidden_layers": mla["num_hidden_layers"],
            "hidden_size": mla["hidden_size"], "intermediate_size": mla["intermediate_size"],
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // GQA_RATIO),
            "head_dim": head_dim, "vocab_size": mla["vocab_size"],
            "max_position_embeddings": mla["max_position_embeddings"]}


def pool_bytes_per_token(hf: dict[str, Any], architecture: str, name: str) -> int:
    """One token's bf16 KV bytes in the engine's pool for `hf`, equal to the planner's figure
    (RuntimeError naming both when not)."""
    cfg = ModelConfig.from_hf_dict(hf | {"architectures": [architecture]})
    pool = KVCache(cfg, num_blocks=1, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    per_token = pool.block_nbytes // BLOCK_SIZE
    planner = kv_bytes_per_token(shape_from_config(hf, name), "bf16")
    static = KVCache.bytes_per_block(cfg, BLOCK_SIZE, torch.bfloat16) // BLOCK_SIZE
    if not per_token == static == planner:
        raise RuntimeError(f"{name}: the engine's pool holds {per_token} bytes a token "
                           f"(bytes_per_block: {static}), the planner counts {planner}")
    return per_token


def kv_per_token_rows() -> list[KvPerTokenRow]:
    rows = []
    for name, mla in _deepseek_configs().items():
        mla_cfg = ModelConfig.from_hf_dict(mla | {"architectures": ["DeepseekV3ForCausalLM"]})
        gqa = _gqa_twin(mla, mla_cfg.head_dim)
        rows.append(KvPerTokenRow(
            model=name, layers=mla_cfg.num_layers, heads=mla_cfg.num_heads,
            mla_bytes=pool_bytes_per_token(mla, "DeepseekV3ForCausalLM", name),
            gqa_kv_heads=gqa["num_key_value_heads"], gqa_head_dim=gqa["head_dim"],
            gqa_bytes=pool_bytes_per_token(gqa, "LlamaForCausalLM", f"{name} GQA twin")))
    return rows


def format_kv_rows(rows: list[KvPerTokenRow]) -> str:
    lines = [f"{'KV bytes per token (bf16)':<26}{'layers':>7}{'MLA latent':>12}"
             f"{'GQA twin':>12}{'KV heads x dim':>16}{'MLA / GQA':>11}"]
    for r in rows:
        lines.append(f"{r.model:<26}{r.layers:>7}{r.mla_bytes:>12,}{r.gqa_bytes:>12,}"
                     f"{f'{r.gqa_kv_heads} x {r.gqa_head_dim}':>16}{r.ratio:>11.3f}")
    return "\n".join(lines)
