"""Builds a model on its device in its dtype and fills it from a Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.model.packed_experts import pack_experts
from pdserve.engine.model.packed_linear import can_pack, pack_linears
from pdserve.engine.model.registry import model_class
from pdserve.engine.model.weights import load_weights
from pdserve.engine.parallel.shard_plan import ShardPlan
from pdserve.engine.parallel.shard_weights import shard_weights


def load_model(
    path: Path, cfg: ModelConfig, dtype: torch.dtype, device: str, max_positions: int,
    cpu_kernels: bool = True, shard: ShardPlan | None = None,
) -> nn.Module:
    """`cpu_kernels`: run a bf16 model on CPU with pdserve's compiled operators where they
    build here (`pdserve.engine.kernels`); PyTorch operators otherwise. `shard`: one
    tensor-parallel rank's share of the heads and MLP and expert columns
    (`engine/parallel/`)."""
    weights = load_weights(path, dtype)
    if shard is not None:
        weights = shard_weights(weights, shard, cfg)
        cfg = shard.local_config(cfg)
    # the operators (bf16 on CPU): every model's linears and experts; each decoder takes the
    # rest of its layer from them where they cover it (`kernels.supports`)
    ops = cpu_ops() if cpu_kernels and device == "cpu" and dtype == torch.bfloat16 else None
    with torch.device("meta"):  # no time spent initialising weights that are overwritten
        model = model_class(cfg.architecture)(cfg, max_positions, device, ops)
    _to_empty(model, device)
    model.to(dtype)
    if cfg.tie_word_embeddings:  # _to_empty() makes new parameters: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_weights(weights)
    if can_pack(device):
        pack_linears(model, ops)
        pack_experts(model, ops)  # routed experts on our kernels, if any
    return model.eval()


def _to_empty(model: nn.Module, device: str) -> None:
    """`model.to_empty(device=device)`, each tensor made by `empty_strided`: to_empty's
    `empty_like` of a meta tensor runs PyTorch's Python reference of it, whose first call
    imports sympy (~0.6 s of every worker's start)."""
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                               device=device))


def eos_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: config.json's, generation_config.json's, the tokenizer's.

    Instruct models often name the chat turn end (e.g. <|im_end|>) only in one of them.
    """
    ids: list[int] = list(ModelConfig.from_folder(path).eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))
