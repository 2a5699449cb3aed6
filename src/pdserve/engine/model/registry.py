"""Which decoder class runs which Hugging Face architecture.

Every name in `ModelConfig`'s `SUPPORTED_ARCHITECTURES` has an entry here (a test holds the
two lists equal). A class is built as `cls(cfg, max_positions, device, fused)` on the meta
device, then filled by its `load_hf_weights`.
"""

from __future__ import annotations

from torch import nn

from pdserve.common.model_config import SUPPORTED_ARCHITECTURES
from pdserve.engine.model.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`; ValueError names the ones this build runs."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; pdserve runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return MODEL_CLASSES[architecture]
