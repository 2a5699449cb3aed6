"""DeepSeek-V2/V3 MoE block (DeepSeekMoE, arXiv 2401.06066): routed experts plus shared
experts that every token goes through; out = experts(x, route(x)) + shared_experts(x), as
transformers' `DeepseekV2Moe` / `DeepseekV3MoE`.

Parameter names (under a decoder layer's `mlp.`): `gate.weight [E, hidden]`,
`gate.e_score_correction_bias [E]` (noaux_tc only), `experts.gate_up_proj [E, 2I, hidden]`,
`experts.down_proj [E, hidden, I]`, `shared_experts.gate_up_proj.weight [2 S, hidden]`,
`shared_experts.down_proj.weight [hidden, S]` with S = n_shared_experts x I.
`convert_moe_weights` turns a checkpoint's tensors of one layer into these names.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from pdserve.common.moe_config import MoeConfig
from pdserve.engine.model.llama import MLP
from pdserve.engine.model.moe import Experts, stack_expert_weights
from pdserve.engine.model.moe_gate import Router


class DeepseekMoE(nn.Module):
    """Built on any device (meta included); filled by the owner's weight copy after
    `convert_moe_weights`. Runs in the model's dtype, except the router: its weight and
    score bias stay fp32 whatever `.to(dtype)` asks (`_apply`), and its logits are fp32, as in
    transformers. `ops`: the compiled CPU operators for the router and the shared experts'
    activation, or None; the routed experts move onto them after loading
    (`packed_experts.py`)."""

    def __init__(self, hidden_size: int, cfg: MoeConfig, ops: ModuleType | None = None) -> None:
        super().__init__()
        if cfg.n_shared_experts <= 0:
            raise ValueError("config.json: DeepSeek MoE layers need n_shared_experts >= 1")
        self.cfg = cfg
        self.gate = Router(hidden_size, cfg, ops)
        self.experts = Experts(cfg.num_experts, hidden_size, cfg.intermediate_size)
        # the n_shared_experts always-on experts: one SwiGLU of their summed width
        self.shared_experts = MLP(hidden_size, cfg.intermediate_size * cfg.n_shared_experts, ops)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        """What `.to()`, `.to_empty()`, `.bfloat16()` run on every tensor: the router's
        tensors follow a move to another device but are never cast, so loading copies the
        checkpoint's fp32 values into fp32 (transformers' `_keep_in_fp32_modules_strict`)."""
        kept = {name: t.data for name, t in
                [*self.gate.named_parameters(), *self.gate.named_buffers()]}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            now = getattr(self.gate, name)
            if now.dtype != before.dtype:
                now.data = before.to(now.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = self.gate(x)  # [T, k] each
        return self.experts(x, ids, weights) + self.shared_experts(x)


def convert_moe_weights(weights: dict[str, torch.Tensor], prefix: str,
                        cfg: MoeConfig) -> dict[str, torch.Tensor]:
    """The tensors of the MoE block under `prefix` (e.g. "layers.3.mlp.", the prefix of
    `DeepseekMoE`'s own names), popped from `weights`, in `DeepseekMoE`'s names and layout:
    experts stacked (from per-expert `experts.{e}.gate_proj/up_proj/down_proj.weight`, or
    already stacked `experts.gate_up_proj` / `experts.down_proj`), shared gate|up fused, gate
    (and bias) as they are. A missing tensor is a ValueError."""
    out = stack_expert_weights(weights, f"{prefix}experts.", cfg.num_experts)
    shared = f"{prefix}shared_experts."
    names = [f"{shared}{p}_proj.weight" for p in ("gate", "up", "down")]
    if f"{shared}gate_up_proj.weight" in weights:
        names = [f"{shared}gate_up_proj.weight", f"{shared}down_proj.weight"]
    gate = [f"{prefix}gate.weight"]
    if cfg.topk_method == "noaux_tc":
        gate.append(f"{prefix}gate.e_score_correction_bias")
    absent = [n for n in names + gate if n not in weights]
    if absent:
        raise ValueError(f"weights are missing MoE tensor(s) {absent[:3]}")
    if len(names) == 3:
        g, u, d = (weights.pop(n) for n in names)
        out[f"{shared}gate_up_proj.weight"] = torch.cat([g, u], dim=0)  # [2S, hidden]
        out[f"{shared}down_proj.weight"] = d  # [hidden, S]
    else:
        out |= {n: weights.pop(n) for n in names}
    out |= {n: weights.pop(n) for n in gate}
    return out
