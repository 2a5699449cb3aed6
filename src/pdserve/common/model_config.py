"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

Only the fields the engine needs; everything else in the HF config is ignored. Unsupported
architectures and missing fields raise `ValueError` naming what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

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
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    sliding_window: int | None = None  # Mistral: caps the usable context
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

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
        if self.attention_bias and self.architecture != "Qwen2ForCausalLM":
            raise ValueError("config.json: attention_bias is only supported for Qwen2 (q/k/v "
                             "biases); this Llama/Mistral variant would need an o_proj bias too")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not supported")

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) the model attends over correctly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x bytes."""
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
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_fields(cfg)
        if cfg.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        arch = archs[0]
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
