"""Mixture-of-experts shape and routing rule, read from a Hugging Face `config.json`.

One `MoeConfig` describes every MoE layer of a model: `num_experts` routed SwiGLU experts of
width `intermediate_size`, `top_k` of them per token, chosen by `topk_method` over
`scoring_func` scores, plus `n_shared_experts` always-on experts (DeepSeek). The fields and
defaults mirror transformers 5.24 (`configuration_qwen3_moe.py`,
`configuration_deepseek_v2.py`, `configuration_deepseek_v3.py`) and which layers are MoE
mirrors their decoder layers. Invariants, checked at construction: every count is positive,
`top_k <= num_experts`, grouped routing has `num_experts % n_group == 0`,
`topk_group <= n_group` and enough experts in the kept groups for `top_k`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN3_MOE = "Qwen3MoeForCausalLM"
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
MOE_ARCHITECTURES = (QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3)

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # routed experts (Qwen3: num_experts; DeepSeek: n_routed_experts)
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size: one expert's SwiGLU width
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False  # renormalise the chosen weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int | None = None  # expert groups (group-limited routing only)
    topk_group: int | None = None  # groups kept per token
    n_shared_experts: int = 0  # DeepSeek: one SwiGLU of n_shared x intermediate_size
    gate_fp32: bool = False  # DeepSeek: router logits in fp32 (transformers keeps it fp32)
    # Which layers are MoE: Qwen3 (decoder_sparse_step, mlp_only_layers); DeepSeek
    # (first_k_dense_replace, moe_layer_freq).
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step",
                     "moe_layer_freq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {_hf_name(name)} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.first_k_dense_replace < 0 or self.n_shared_experts < 0:
            raise ValueError("config.json: first_k_dense_replace and n_shared_experts must not "
                             "be negative")
        if self.top_k > self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) must not exceed "
                             f"the number of experts ({self.num_experts})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config.json: topk_method {self.topk_method!r} is not supported; "
                             f"supported: {', '.join(TOPK_METHODS)}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"config.json: scoring_func {self.scoring_func!r} is not supported; "
                             f"supported: {', '.join(SCORING_FUNCS)}")
        if self.grouped:
            self._check_groups()

    @property
    def grouped(self) -> bool:
        """Whether routing first keeps `topk_group` of `n_group` expert groups."""
        return self.topk_method != "greedy"

    def _check_groups(self) -> None:
        n, kept = self.n_group, self.topk_group
        if n is None or kept is None or n <= 0 or kept <= 0:
            raise ValueError(f"config.json: topk_method {self.topk_method!r} needs positive "
                             f"n_group and topk_group, got {n} and {kept}")
        if self.num_experts % n:
            raise ValueError(f"config.json: n_routed_experts ({self.num_experts}) must be a "
                             f"multiple of n_group ({n})")
        if kept > n:
            raise ValueError(f"config.json: topk_group ({kept}) must not exceed n_group ({n})")
        if self.top_k > kept * (self.num_experts // n):
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) exceeds the "
                             f"experts in topk_group ({kept}) groups")
        if self.topk_method == "noaux_tc" and self.num_experts // n < 2:
            raise ValueError("config.json: noaux_tc scores a group by its top-2 experts: "
                             "n_routed_experts / n_group must be at least 2")

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` (0-based) has the MoE block instead of the dense MLP."""
        if i in self.mlp_only_layers:
            return False
        if (i + 1) % self.decoder_sparse_step:
            return False
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], architecture: str) -> MoeConfig | None:
        """The MoE fields of `cfg` for `architecture`; None for a dense architecture."""
        if architecture == QWEN3_MOE:
            return _qwen3_moe(cfg)
        if architecture in (DEEPSEEK_V2, DEEPSEEK_V3):
            return _deepseek(cfg, architecture == DEEPSEEK_V3)
        return None


def _qwen3_moe(cfg: dict[str, Any]) -> MoeConfig:
    """transformers' `Qwen3MoeConfig` defaults; it saves the expert count as
    `num_local_experts`, the Hub's configs name it `num_experts`."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_int(i) for i in only):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got "
                         f"{only!r}")
    return MoeConfig(
        num_experts=_int("num_experts", experts),
        top_k=_int("num_experts_per_tok", cfg.get("num_experts_per_tok", 8)),
        intermediate_size=_int("moe_intermediate_size", cfg.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=_int("decoder_sparse_step", cfg.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(only),
    )


def _deepseek(cfg: dict[str, Any], v3: bool) -> MoeConfig:
    """transformers' `DeepseekV2Config` / `DeepseekV3Config` defaults. transformers' V3 router
    is always sigmoid + noaux_tc and its V2 router always softmax, scaled and never
    renormalised, and both place MoE by `first_k_dense_replace` alone: configs that ask
    otherwise are refused rather than run differently from the reference."""
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise ValueError(f"config.json: topk_method {method!r} is not supported for "
                         f"{DEEPSEEK_V3 if v3 else DEEPSEEK_V2}; supported: {', '.join(allowed)}")
    if scoring != ("sigmoid" if v3 else "softmax") and scoring in SCORING_FUNCS:
        raise ValueError(f"config.json: scoring_func {scoring!r} is not supported with "
                         f"topk_method {method!r}")
    norm = bool(cfg.get("norm_topk_prob", v3))
    if norm and not v3:
        raise ValueError("config.json: norm_topk_prob true is not supported for DeepSeek-V2 "
                         "(transformers ignores it, DeepSeek's code renormalises instead of "
                         "scaling); released V2 checkpoints set it false")
    freq = _int("moe_layer_freq", cfg.get("moe_layer_freq", 1))
    if freq != 1:
        raise ValueError(f"config.json: moe_layer_freq {freq} is not supported (only 1, as "
                         "every released DeepSeek checkpoint)")
    groups, kept = cfg.get("n_group", 8 if v3 else None), cfg.get("topk_group", 4 if v3 else None)
    return MoeConfig(
        num_experts=_int("n_routed_experts", cfg.get("n_routed_experts", 256 if v3 else 64)),
        top_k=_int("num_experts_per_tok", cfg.get("num_experts_per_tok", 8 if v3 else None)),
        intermediate_size=_int("moe_intermediate_size",
                               cfg.get("moe_intermediate_size", 2048 if v3 else 1407)),
        topk_method=method,
        scoring_func=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        n_group=None if groups is None else _int("n_group", groups),
        topk_group=None if kept is None else _int("topk_group", kept),
        n_shared_experts=_int("n_shared_experts", cfg.get("n_shared_experts", 1 if v3 else 2)),
        gate_fp32=True,
        first_k_dense_replace=_int("first_k_dense_replace",
                                   cfg.get("first_k_dense_replace", 3 if v3 else 0)),
        moe_layer_freq=freq,
    )


_HF_NAMES = {"num_experts": "num_experts (DeepSeek: n_routed_experts)",
             "top_k": "num_experts_per_tok", "intermediate_size": "moe_intermediate_size"}


def _hf_name(field_name: str) -> str:
    return _HF_NAMES.get(field_name, field_name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(f"config.json: {name} must be an integer, got {value!r}")
    return value  # type: ignore[return-value]
