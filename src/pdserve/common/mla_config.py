"""Multi-head Latent Attention shape (DeepSeek-V2/V3), read from a Hugging Face `config.json`.

MLA (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1.2) caches per token and layer one
compressed latent c_KV of `kv_lora_rank` values and one rotary key of `qk_rope_head_dim` values
shared by every head; keys and values of each head are re-derived from the latent. Invariants:
every width is a positive int; `q_lora_rank` is None (a plain q_proj, as DeepSeek-V2-Lite) or
positive (q_a_proj -> q_a_layernorm -> q_b_proj); `qk_rope_head_dim` is even (rotary pairs).
`rope_interleave`: the rotary part pairs adjacent values (x0, x1), (x2, x3), ... as DeepSeek's
checkpoints do (transformers: always for V2, V3's `rope_interleave`, default true), else it
pairs the two halves (x_i, x_{i + d/2}) as Llama does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MlaConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in _FIELDS:
            _check_positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _check_positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.json: qk_rope_head_dim must be even (rotary pairs), got "
                             f"{self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of q and k: the no-position part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: c_KV then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MlaConfig:
        """The MLA fields of a DeepSeek config.json; ValueError names a missing or bad field.
        A DeepseekV2ForCausalLM always interleaves its rotary pairs (transformers ignores
        `rope_interleave` there)."""
        v2 = (cfg.get("architectures") or [None])[0] == "DeepseekV2ForCausalLM"
        missing = [k for k in _FIELDS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing MLA field(s): {', '.join(missing)} "
                             "(DeepSeek-V2/V3 configs carry them)")
        q_rank = cfg.get("q_lora_rank")
        return cls(
            q_lora_rank=None if q_rank is None else _int("q_lora_rank", q_rank),
            **{k: _int(k, cfg[k]) for k in _FIELDS},
            rope_interleave=v2 or bool(cfg.get("rope_interleave", True)),
        )


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json: {name} must be an integer, got {value!r}")
    return value


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
