"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

Only the fields the engine needs; everything else in the HF config is ignored. Unsupported
architectures and missing fields raise `ValueError` naming what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.common.mla_config import MlaConfig
from pdserve.common.moe_config import MOE_ARCHITECTURES, MoeConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Decoders with RMSNorm on each q and k head before RoPE (`qk_norm`).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Decoders with Multi-head Latent Attention (`mla` set): their rotary part may use YaRN.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Decoders that may set `attention_bias`.
BIAS_ARCHITECTURES = ("Qwen2ForCausalLM", *MLA_ARCHITECTURES)

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q, k, v biases; DeepSeek: q_a, kv_a, o biases
    sliding_window: int | None = None  # Mistral: caps the usable context
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    mla: MlaConfig | None = None  # DeepSeek-V2/V3: latent KV (see mla_config.py)
    moe: MoeConfig | None = None  # Qwen3-MoE, DeepSeek-V2/V3: routed experts (moe_config.py)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; pdserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.attention_bias and self.architecture not in BIAS_ARCHITECTURES:
            raise ValueError(f"config.json: attention_bias is only supported for "
                             f"{', '.join(BIAS_ARCHITECTURES)} (Qwen2: q/k/v biases; DeepSeek: "
                             f"q_a_proj, kv_a_proj_with_mqa and o_proj biases); this "
                             f"{self.architecture} would need biases pdserve does not load")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"{self.architecture}: the MoE fields must be given exactly for "
                             f"{', '.join(MOE_ARCHITECTURES)}")
        if self.qk_norm and self.architecture not in QK_NORM_ARCHITECTURES:
            raise ValueError(f"{self.architecture}: q/k norm is only supported for "
                             f"{', '.join(QK_NORM_ARCHITECTURES)}")
        if (self.mla is not None) != (self.architecture in MLA_ARCHITECTURES):
            raise ValueError(f"{self.architecture}: the MLA fields must be given exactly for "
                             f"{', '.join(MLA_ARCHITECTURES)}")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        allowed = ("default", "yarn") if self.mla is not None else ("default", "llama3")
        if rope_type not in allowed:
            raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not supported for "
                             f"{self.architecture}; supported: {', '.join(allowed)}")
        if rope_type == "yarn" and not isinstance(scaling.get("factor"), int | float):
            raise ValueError("config.json: rope_scaling of type 'yarn' needs a numeric 'factor'")

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) the model attends over correctly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x bytes; with MLA the
        latent and rotary key: layers x (kv_lora_rank + qk_rope_head_dim) x bytes (DeepSeek-V2
        paper, arXiv 2405.04434, section 2.1.2; the planner's `kv_math` formula)."""
        if self.mla is not None:
            return self.num_layers * self.mla.latent_dim * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field")
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"config.json is missing required field(s): {', '.join(missing)}")
        num_heads = int(cfg["num_attention_heads"])
        arch = archs[0]
        mla = MlaConfig.from_hf_dict(cfg) if arch in MLA_ARCHITECTURES else None
        # MLA: the q.k width of a head (DeepSeek's config.json head_dim is the rotary part)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        if mla is not None:
            head_dim = mla.qk_head_dim
        rope_theta, rope_scaling = _rope_fields(cfg)
        if cfg.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
                            else None),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=cfg.get("bos_token_id"),
            mla=mla,
            moe=MoeConfig.from_hf_dict(cfg, arch),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
        )

    @classmethod
    def from_folder(cls, path: Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path} must hold a JSON object, got {type(cfg).__name__}")
        return cls.from_hf_dict(cfg)


def _rope_fields(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers < 5 writes top-level `rope_theta` and `rope_scaling`; transformers >= 5 writes
    only `rope_parameters` = {"rope_theta": ..., "rope_type": ..., scaling fields}. A default
    (unscaled) rope comes back as rope_scaling None in both layouts.
    """
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling
