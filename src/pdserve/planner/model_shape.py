"""The shape of a decoder as the planner sees it: attention kind, KV width, parameter counts.

Read from a Hugging Face `config.json` (a file, a model folder, or one of `PRESETS`, which are
the published config.json values themselves, so presets and files go through one reader).
Unlike the engine's `ModelConfig`, this reader also takes MLA (DeepSeek-V2/V3) and MoE configs:
it never runs the model, it only counts.

Parameter counts are derived from the shape, never typed in, so a config file gets them too.
Formula sources (per layer; all projections without bias unless said):
- GQA attention (Llama, Qwen2; HF `LlamaAttention`): q = hidden x heads x head_dim,
  k and v = hidden x kv_heads x head_dim each, o = heads x head_dim x hidden. Qwen2 adds biases
  on q, k, v (heads x head_dim + 2 x kv_heads x head_dim).
- MLA attention (DeepSeek-V2 paper, arXiv 2405.04434, eqs. 9-14 and 37-38):
  q = hidden x q_lora_rank + q_lora_rank (norm) + q_lora_rank x heads x (nope + rope)
  (or hidden x heads x (nope + rope) without q_lora_rank); kv_a = hidden x (kv_lora_rank + rope);
  kv norm = kv_lora_rank; kv_b = kv_lora_rank x heads x (nope + v_head_dim);
  o = heads x v_head_dim x hidden.
- SwiGLU MLP (Llama paper, arXiv 2302.13971, section 2): gate, up, down = 3 x hidden x inter.
- MoE (DeepSeek-V3 report, arXiv 2412.19437, section 2.1.2; Mixtral): each routed expert and
  each shared expert is one SwiGLU MLP of moe_intermediate_size; the router is
  routed_experts x hidden. Layer i is MoE when i >= first_k_dense_replace and
  i % moe_layer_freq == 0.
- RMSNorm: hidden per norm, two per layer plus the final one.
- Embedding vocab x hidden; the LM head another vocab x hidden unless tie_word_embeddings.
DeepSeek-V3's multi-token-prediction module (num_nextn_predict_layers) is not counted: the
671B total it publishes is the main model without it.

Invariants: every count is a positive int; GQA has num_heads % num_kv_heads == 0 and no MLA
fields; MLA has kv_lora_rank > 0 and qk_rope_head_dim > 0; MoE has 1 <= experts_per_token <=
routed_experts and 1 <= moe_layers <= num_layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pdserve.planner.kv_math import DTYPE_BYTES


class AttentionKind(StrEnum):
    GQA = "GQA"  # MHA is GQA with kv_heads == heads
    MLA = "MLA"


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MoEShape:
    """Routed experts of a mixture-of-experts model (shared experts count as dense params)."""

    routed_experts: int
    experts_per_token: int
    params_per_expert: int
    moe_layers: int

    def __post_init__(self) -> None:
        _check_positive("MoEShape", routed_experts=self.routed_experts,
                        experts_per_token=self.experts_per_token,
                        params_per_expert=self.params_per_expert, moe_layers=self.moe_layers)
        if self.experts_per_token > self.routed_experts:
            raise ValueError(
                f"MoEShape: experts_per_token ({self.experts_per_token}) must not exceed "
                f"routed_experts ({self.routed_experts})"
            )

    @property
    def total_params(self) -> int:
        """All routed experts: moe_layers x routed_experts x params per expert."""
        return self.moe_layers * self.routed_experts * self.params_per_expert

    @property
    def active_params(self) -> int:
        """Routed experts one token uses: moe_layers x experts_per_token x params per expert."""
        return self.moe_layers * self.experts_per_token * self.params_per_expert

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per layer that `tokens` tokens route to.

        Occupancy formula under uniform, independent routing: a token picks a given expert with
        probability k/E, so the expert stays idle for all tokens with probability (1 - k/E)^n,
        giving E x (1 - (1 - k/E)^n). Real routers are skewed, so this is an upper estimate.
        """
        e, k = self.routed_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def params_read(self, tokens: int) -> float:
        """Expected routed-expert params a step over `tokens` tokens reads from memory."""
        return self.moe_layers * self.experts_touched(tokens) * self.params_per_expert


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model. Build with `load_model_shape` or `shape_from_config`.

    `body_dense_params` is every transformer-block parameter every token uses (attention, dense
    MLPs, shared experts, routers, norms, final norm): everything except the embedding, the LM
    head and the routed experts.
    """

    name: str
    attention: AttentionKind
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    qk_head_dim: int  # per-head width of q.k (GQA: head_dim; MLA: nope + rope)
    v_head_dim: int  # per-head width of v (GQA: head_dim)
    body_dense_params: int
    num_kv_heads: int = 0  # GQA only
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only
    moe: MoEShape | None = None
    tie_word_embeddings: bool = False
    weight_dtype: str = "bf16"
    max_position_embeddings: int | None = None  # None: not stated

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", AttentionKind(self.attention))
        _check_positive(f"model {self.name}", num_layers=self.num_layers,
                        hidden_size=self.hidden_size, num_heads=self.num_heads,
                        vocab_size=self.vocab_size, qk_head_dim=self.qk_head_dim,
                        v_head_dim=self.v_head_dim, body_dense_params=self.body_dense_params)
        if self.weight_dtype not in DTYPE_BYTES:
            raise ValueError(f"model {self.name}: weight_dtype must be one of "
                             f"{', '.join(DTYPE_BYTES)}, got {self.weight_dtype!r}")
        if self.is_mla:
            self._check_mla()
        else:
            self._check_gqa()
        if self.max_position_embeddings is not None:
            _check_positive(f"model {self.name}",
                            max_position_embeddings=self.max_position_embeddings)
        if self.moe is not None and self.moe.moe_layers > self.num_layers:
            raise ValueError(f"model {self.name}: moe_layers ({self.moe.moe_layers}) exceeds "
                             f"num_layers ({self.num_layers})")

    def _check_gqa(self) -> None:
        _check_positive(f"model {self.name}", num_kv_heads=self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_attention_heads ({self.num_heads}) must be "
                             f"a multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.kv_lora_rank or self.qk_rope_head_dim:
            raise ValueError(f"model {self.name}: a GQA model has no kv_lora_rank or "
                             "qk_rope_head_dim; set attention=MLA for a latent-KV model")
        if self.qk_head_dim != self.v_head_dim:
            raise ValueError(f"model {self.name}: GQA needs qk_head_dim == v_head_dim "
                             f"(head_dim), got {self.qk_head_dim} and {self.v_head_dim}")

    def _check_mla(self) -> None:
        _check_positive(f"model {self.name}", kv_lora_rank=self.kv_lora_rank,
                        qk_rope_head_dim=self.qk_rope_head_dim)

    @property
    def is_mla(self) -> bool:
        return self.attention is AttentionKind.MLA

    @property
    def head_dim(self) -> int:
        """GQA head_dim (q, k and v share it)."""
        return self.qk_head_dim

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """Cached values per token per layer: GQA 2 x kv_heads x head_dim; MLA d_c + d_rope."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        """Input embedding table: vocab x hidden (a lookup: memory, no FLOPs)."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """LM head matmul: vocab x hidden (the embedding table itself when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def body_active_params(self) -> int:
        """Block params one token multiplies by: dense body + its routed experts."""
        return self.body_dense_params + (self.moe.active_params if self.moe else 0)

    @property
    def _untied_head(self) -> int:
        return 0 if self.tie_word_embeddings else self.lm_head_params

    @property
    def params_total(self) -> int:
        """Stored params: embedding + body (all experts) + untied LM head."""
        routed = self.moe.total_params if self.moe else 0
        return self.embedding_params + self.body_dense_params + routed + self._untied_head

    @property
    def params_active(self) -> int:
        """Params one token uses: embedding + active body + untied LM head."""
        return self.embedding_params + self.body_active_params + self._untied_head

    @property
    def weight_bytes_per_param(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]


# ---- presets: the published config.json values (only the keys this reader uses) ---------------

PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (8.03B params;
    # head_dim implicit: 4096 / 32 = 128)
    "llama-3.1-8b": {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (70.6B params;
    # head_dim implicit: 8192 / 64 = 128)
    "llama-3.1-70b": {
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json (72.7B params;
    # head_dim implicit: 8192 / 64 = 128; Qwen2 has q/k/v biases)
    "qwen2.5-72b": {
        "model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192,
        "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 152064, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json and the model card
    # (671B total, 37B activated per token; weights shipped in fp8 e4m3, 128x128 blocks)
    "deepseek-v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    },
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json
    # (134.5M params; head_dim implicit: 576 / 9 = 64; tied embeddings)
    "smollm2-135m": {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
}


# ---- reading a Hugging Face config.json -------------------------------------------------------


def _get_int(cfg: dict[str, Any], key: str, source: str, default: int | None = None,
             minimum: int = 1) -> int:
    """cfg[key] as an int >= minimum; ValueError naming `key` and `source` when absent or bad.

    An absent (or null) key takes `default`; with no default it is an error.
    """
    value = cfg.get(key)
    if value is None:
        if default is not None:
            return default
        raise ValueError(f"{source} is missing {key!r}: the planner needs it (a positive integer "
                         "from the model's Hugging Face config.json)")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{source}: {key!r} must be {kind}, got {value!r}")
    return value


def _gqa_fields(cfg: dict[str, Any], source: str, hidden: int, heads: int) -> dict[str, Any]:
    """GQA shape and per-layer attention params (HF defaults: kv_heads = heads,
    head_dim = hidden / heads, as transformers' LlamaConfig documents)."""
    kv_heads = _get_int(cfg, "num_key_value_heads", source, default=heads)
    if cfg.get("head_dim") is None and hidden % heads:
        raise ValueError(f"{source} is missing 'head_dim' and hidden_size ({hidden}) is not a "
                         f"multiple of num_attention_heads ({heads}); add head_dim")
    head_dim = _get_int(cfg, "head_dim", source, default=hidden // heads)
    params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    if cfg.get("attention_bias", cfg.get("model_type") == "qwen2"):
        params += heads * head_dim + 2 * kv_heads * head_dim  # q, k, v biases (Qwen2)
    return {"attention": AttentionKind.GQA, "num_kv_heads": kv_heads, "qk_head_dim": head_dim,
            "v_head_dim": head_dim, "attention_params": params}


def _mla_fields(cfg: dict[str, Any], source: str, hidden: int, heads: int) -> dict[str, Any]:
    """MLA shape and per-layer attention params (DeepSeek-V2 paper, section 2.1)."""
    kv_rank = _get_int(cfg, "kv_lora_rank", source)
    rope = _get_int(cfg, "qk_rope_head_dim", source)
    nope = _get_int(cfg, "qk_nope_head_dim", source)
    v_dim = _get_int(cfg, "v_head_dim", source)
    q_rank = _get_int(cfg, "q_lora_rank", source, default=0, minimum=0)  # null in V2-Lite
    qk_dim = nope + rope
    if q_rank:  # low-rank query: down-projection, its RMSNorm, up-projection
        q_params = hidden * q_rank + q_rank + q_rank * heads * qk_dim
    else:
        q_params = hidden * heads * qk_dim
    kv_params = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    o_params = heads * v_dim * hidden
    return {"attention": AttentionKind.MLA, "kv_lora_rank": kv_rank, "qk_rope_head_dim": rope,
            "qk_head_dim": qk_dim, "v_head_dim": v_dim,
            "attention_params": q_params + kv_params + o_params}


def _moe_layer_count(cfg: dict[str, Any], source: str, layers: int) -> int:
    """Layers i with i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek layout;
    Mixtral has neither key, so every layer)."""
    first_dense = _get_int(cfg, "first_k_dense_replace", source, default=0, minimum=0)
    freq = _get_int(cfg, "moe_layer_freq", source, default=1)
    return sum(1 for i in range(layers) if i >= first_dense and i % freq == 0)


def _routed_experts(cfg: dict[str, Any], source: str) -> int:
    """Routed experts per MoE layer under any of the names HF configs use; 0 for dense."""
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if cfg.get(key) is not None:
            return _get_int(cfg, key, source, minimum=0)
    return 0


def _mlp_fields(cfg: dict[str, Any], source: str, hidden: int, layers: int) -> dict[str, Any]:
    """Dense-MLP params over all layers, plus the MoE shape when the config routes experts."""
    experts = _routed_experts(cfg, source)
    moe_layers = _moe_layer_count(cfg, source, layers) if experts else 0
    dense_layers = layers - moe_layers
    dense = 0
    if dense_layers:
        dense = dense_layers * 3 * hidden * _get_int(cfg, "intermediate_size", source)
    if not moe_layers:
        return {"mlp_params": dense, "moe": None}
    inter_key = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
    expert = 3 * hidden * _get_int(cfg, inter_key, source)  # one SwiGLU expert (Mixtral: same size)
    shared = _get_int(cfg, "n_shared_experts", source, default=0, minimum=0) * expert
    router = experts * hidden
    moe = MoEShape(routed_experts=experts,
                   experts_per_token=_get_int(cfg, "num_experts_per_tok", source),
                   params_per_expert=expert, moe_layers=moe_layers)
    return {"mlp_params": dense + moe_layers * (shared + router), "moe": moe}


def _weight_dtype(cfg: dict[str, Any]) -> str:
    """fp8 when the checkpoint is fp8-quantized (DeepSeek-V3), fp16 when stored so, else bf16."""
    quant = cfg.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        return "fp8"
    return "fp16" if cfg.get("torch_dtype", cfg.get("dtype")) == "float16" else "bf16"


def shape_from_config(cfg: dict[str, Any], name: str, source: str | None = None) -> ModelShape:
    """ModelShape from a parsed config.json. MLA when the config has a kv_lora_rank."""
    source = source or f"config for {name}"
    layers = _get_int(cfg, "num_hidden_layers", source)
    hidden = _get_int(cfg, "hidden_size", source)
    heads = _get_int(cfg, "num_attention_heads", source)
    vocab = _get_int(cfg, "vocab_size", source)
    is_mla = cfg.get("kv_lora_rank") is not None
    attn = (_mla_fields if is_mla else _gqa_fields)(cfg, source, hidden, heads)
    mlp = _mlp_fields(cfg, source, hidden, layers)
    norms = 2 * hidden  # input and post-attention RMSNorm
    body = layers * (attn.pop("attention_params") + norms) + mlp["mlp_params"] + hidden
    return ModelShape(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                      vocab_size=vocab, body_dense_params=body, moe=mlp["moe"],
                      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                      weight_dtype=_weight_dtype(cfg),
                      max_position_embeddings=cfg.get("max_position_embeddings"), **attn)


def _read_config_file(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise ValueError(f"model folder {path} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {cfg_path} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"model: {cfg_path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def load_model_shape(model: str) -> ModelShape:
    """A preset name (case-insensitive) or a path to a config.json or a model folder."""
    key = model.strip().lower()
    if key in PRESETS:
        return shape_from_config(PRESETS[key], name=key, source=f"preset {key}")
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model (--model) {model!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor an existing config.json file or model folder")
    cfg = _read_config_file(path)
    return shape_from_config(cfg, name=model, source=f"config {path}")
