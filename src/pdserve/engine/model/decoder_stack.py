"""The shell every decoder here shares: token embeddings -> one rotary embedding per step ->
the decoder layers -> final norm -> LM head (`LlamaForCausalLM`, `Qwen3ForCausalLM`,
`DeepseekForCausalLM` differ only in their layers, their rotary tables and their checkpoint
names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.model.weights import copy_weights

# (layer, x, residual, layer's KV tensors) -> (layer's output, residual stream before it)
LayerCall = Callable[[nn.Module, torch.Tensor, torch.Tensor | None, tuple],
                     tuple[torch.Tensor, torch.Tensor]]


class DecoderStack(nn.Module):
    """Embeddings, layers, final norm and LM head, under the names transformers gives them
    (`embed_tokens`, `layers.{i}`, `norm`, `lm_head`): the loaders and the tensor-parallel
    shard plan rely on them. With `tie_word_embeddings` `lm_head.weight` is the embedding's.

    Invariants of `forward`:
    - layer i is called as `layer(x, residual, rope, kv, meta)`, x the previous layer's output
      (the embeddings, with residual None, for layer 0), and returns (its output, the residual
      stream before it): each residual add is fused into the norm after it, the last into
      `norm`, called as `norm(x, residual)` -> (normed, sum).
    - `rope` is made once per forward (`step_rope`) and shared by every layer.
    - `after_layer(i)` runs once per layer, in order, right after layer i returns; by then
      layer i has stored this batch's KV in `kv_cache.layers[i]` (on CUDA: queued).

    A subclass sets `self.rope` and defines `step_rope`; `layer_call` may give a step another
    call of its layers with the same result.
    """

    def __init__(self, cfg: ModelConfig, layers: Iterable[nn.Module], norm: nn.Module,
                 fused: ModuleType | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.fused = fused
        # an uninitialised table (`_weight`), as the checkpoint overwrites it: nn.Embedding's
        # normal_() init on the meta device would import torch._dynamo (~1 s a process)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size,
            _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        call = self.layer_call(positions, meta, self.step_rope(positions, x.dtype))
        residual = None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_cache.layers, strict=True)):
            x, residual = call(layer, x, residual, kv)
            if after_layer is not None:
                after_layer(i)
        return self.norm(x, residual)[0]  # [T, hidden]

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The rotary embedding of one step's tokens, passed to every layer."""
        raise NotImplementedError(f"{type(self).__name__} defines no step_rope")

    def layer_call(self, positions: torch.Tensor, meta: AttentionMetadata,
                   rope: Any) -> LayerCall:
        """How this step runs each layer: its `forward`."""
        return lambda layer, x, residual, kv: layer(x, residual, rope, kv, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab]

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a HF state dict in: "model." dropped, each layer's tensors renamed by
        `convert_layer`, `lm_head.weight` the checkpoint's or, tied, the embedding's; any
        missing tensor is an error."""
        own = {k.removeprefix("model."): v for k, v in weights.items()}
        for i in range(self.cfg.num_layers):
            self.convert_layer(own, i)
        if "lm_head.weight" in weights:
            own["lm_head.weight"] = weights["lm_head.weight"]
        elif self.cfg.tie_word_embeddings:
            own["lm_head.weight"] = own["embed_tokens.weight"]
        copy_weights(self, own)

    def convert_layer(self, weights: dict[str, torch.Tensor], index: int) -> None:
        """Rename layer `index`'s tensors in `weights` (prefix "layers.{index}.") from the
        checkpoint's names and layout to this model's, in place; as they are by default."""
