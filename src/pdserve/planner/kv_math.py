"""KV-cache bytes and the time to move them over a link.

Formulas:
- MHA/GQA: every layer keeps a K and a V vector per KV head per token, so
  bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes.
- MLA (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1.2; DeepSeek-V3 keeps it): every layer
  keeps one compressed latent c_KV of kv_lora_rank values plus one decoupled RoPE key of
  qk_rope_head_dim values, shared by all heads, so
  bytes/token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes.
- Wire time = bytes x 8 / (link Gb/s x 1e9): link speeds are decimal gigabits per second
  (IEEE 802.3 line rates, e.g. 100GBASE-*). Protocol overhead is ignored, so this is a floor.

Tensor parallelism: GQA splits the KV heads across ranks (a rank holds kv_heads / tp heads; when
tp exceeds kv_heads each head is replicated on tp / kv_heads ranks and a rank holds one). MLA's
latent is not split by heads: every rank holds the whole latent (replicated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.planner.model_shape import ModelShape

# Bytes per value of each storage format the planner knows.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}

BITS_PER_BYTE = 8
GIGA = 1e9


def dtype_bytes(dtype: str, field: str = "kv_dtype") -> int:
    """Bytes per value of `dtype`; ValueError naming `field` for an unknown format."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(
            f"{field} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}"
        )
    return DTYPE_BYTES[dtype]


def check_tp(tp: int) -> None:
    """ValueError unless `tp` is a positive integer."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp (--tp) must be a positive integer (GPUs per worker), got {tp!r}")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank holds: kv_heads / tp, or 1 (replicated) when tp > kv_heads.

    Either tp divides kv_heads or kv_heads divides tp; otherwise heads cannot be dealt evenly.
    """
    check_tp(tp)
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ValueError(
        f"tp (--tp) {tp} cannot split {num_kv_heads} KV heads evenly: pick a tp that divides "
        f"{num_kv_heads} or a multiple of it"
    )


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """Whole-model KV bytes for one token: layers x values per token per layer x dtype bytes."""
    return shape.num_layers * shape.kv_values_per_token_per_layer * dtype_bytes(kv_dtype)


def kv_bytes_per_token_per_rank(shape: ModelShape, kv_dtype: str, tp: int) -> int:
    """KV bytes one TP rank holds per token (GQA: heads split; MLA: latent replicated)."""
    if shape.is_mla:
        check_tp(tp)
        return kv_bytes_per_token(shape, kv_dtype)
    heads = kv_heads_per_rank(shape.num_kv_heads, tp)
    # 2 (K and V) x layers x heads on this rank x head_dim x bytes (the MHA/GQA formula above).
    return 2 * shape.num_layers * heads * shape.head_dim * dtype_bytes(kv_dtype)


def kv_bytes(bytes_per_token: int, tokens: int) -> int:
    """KV bytes of `tokens` tokens: bytes per token x tokens (the prompt's KV is what moves)."""
    return bytes_per_token * tokens


def check_link(link_gbps: float) -> None:
    """ValueError unless the link speed is a positive number."""
    if isinstance(link_gbps, bool) or not isinstance(link_gbps, int | float) or not (
        link_gbps > 0 and link_gbps != float("inf")
    ):
        raise ValueError(
            f"link_gbps (--link-gbps) must be a positive, finite link speed in Gb/s, "
            f"got {link_gbps!r}"
        )


def transfer_seconds(nbytes: int, link_gbps: float) -> float:
    """Wire time: bytes x 8 bits / (Gb/s x 1e9 bit/s). A floor: no protocol overhead."""
    check_link(link_gbps)
    return nbytes * BITS_PER_BYTE / (link_gbps * GIGA)


def breakeven_link_gbps(nbytes: int, seconds: float) -> float:
    """The link speed (Gb/s) that moves `nbytes` in exactly `seconds`: bytes x 8 / s / 1e9."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return nbytes * BITS_PER_BYTE / seconds / GIGA
