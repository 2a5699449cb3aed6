"""The shape of a KV pool as far as moving bytes between pools depends on it: `KVLayout`.

Two workers can exchange KV only when their layouts are equal field by field
(`KVLayout.check_compatible` names the first difference); the router refuses a worker whose
layout differs from its cluster's (`router/compat.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from pdserve.transfer.wire import U32, exact_keys, require_int, require_str

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

# The pool layouts of `engine/kv_cache.py`. Paged K/V: a (block, layer) slice is [2, block_size,
# kv_heads, head_dim]. Latent (MLA): a slice is [1, block_size, 1, latent], each token's row the
# normalised c_KV then the rotated key; its KVLayout has kv_heads 1 and head_dim = latent width
# (kv_lora_rank + qk_rope_head_dim).
LAYOUT_PAGED_KV = "paged_kv[block,layer,kv=2,token,kv_head,head_dim]"
LAYOUT_PAGED_MLA = "paged_mla[block,layer,token,latent]"
_SLICE_SHAPES = {
    LAYOUT_PAGED_KV: lambda lay: (2, lay.block_size, lay.kv_heads, lay.head_dim),
    LAYOUT_PAGED_MLA: lambda lay: (1, lay.block_size, 1, lay.head_dim),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class KVLayout:
    """The shape of a peer's KV pool, as far as moving bytes between pools depends on it.

    `layout` names the pool layout and so the shape of one (block, layer) slice; nothing else
    here assumes K and V per head (a latent MLA pool is another `layout`).
    """

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    layout: str = LAYOUT_PAGED_KV

    def __post_init__(self) -> None:
        require_str("KVLayout.model_id", self.model_id)
        if type(self.dtype) is not str or self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} unknown; use one of {sorted(DTYPE_BYTES)}"
            )
        for name in ("block_size", "num_layers", "kv_heads", "head_dim"):
            require_int(f"KVLayout.{name}", getattr(self, name), 1, U32)
        if type(self.layout) is not str or self.layout not in _SLICE_SHAPES:
            raise ValueError(f"KVLayout.layout {self.layout!r} unknown; this build knows "
                             f"{sorted(_SLICE_SHAPES)}")
        if self.layout == LAYOUT_PAGED_MLA and self.kv_heads != 1:
            raise ValueError(f"KVLayout.kv_heads must be 1 for {LAYOUT_PAGED_MLA} (one latent "
                             f"row per token), got {self.kv_heads}")

    @classmethod
    def of_cache(cls, cache: KVCache, model_id: str) -> KVLayout:
        """The layout of an engine's `KVCache` (paged K/V, or the latent pool of MLA)."""
        _, num_layers, _, block_size, kv_heads, head_dim = cache.data.shape
        dtype = str(cache.data.dtype).removeprefix("torch.")
        layout = LAYOUT_PAGED_MLA if cache.is_latent else LAYOUT_PAGED_KV
        return cls(model_id, dtype, block_size, num_layers, kv_heads, head_dim, layout)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """Shape of one (block, layer) slice of the pool."""
        return _SLICE_SHAPES[self.layout](self)

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token takes over every layer: a slice's bytes / block_size x layers."""
        return self.slice_nbytes // self.block_size * self.num_layers

    @property
    def slice_nbytes(self) -> int:
        return math.prod(self.slice_shape) * DTYPE_BYTES[self.dtype]

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ValueError naming the first field in which the two pools differ."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise ValueError(
                    f"incompatible KV layout: {f.name} is {mine!r} here but {theirs!r} at the "
                    "peer; both workers must serve the same model with the same KV dtype, "
                    "block size and pool layout"
                )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, obj: object) -> KVLayout:
        d = exact_keys("layout", obj, [f.name for f in fields(cls)])
        return cls(**d)
