"""Read a model folder's weights (`pdserve.common.model_folder` finds and checks the folder)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pdserve.common.model_folder import INDEX_FILE, read_index, weight_files

# Tensors loaded as stored, not cast to the model's dtype: DeepSeek's router weight and score
# bias, which transformers keeps in fp32 whatever the model's dtype
# (`_keep_in_fp32_modules_strict`) and `DeepseekMoE` holds in fp32, so routing sees the
# checkpoint's values bit for bit. A
# Qwen3-MoE router has the same name and a parameter of the model's dtype: `copy_weights`
# rounds it into that dtype exactly as a cast here would.
KEEP_STORED_DTYPE = re.compile(r"(^|\.)mlp\.gate\.(weight|e_score_correction_bias)$")


def load_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors, by HF parameter name, floats cast to `dtype`.

    Names are exactly as stored: a tied-embedding model has no `lm_head.weight`. Integer
    tensors and the routers' `KEEP_STORED_DTYPE` tensors keep their dtype. Each name appears in
    exactly one shard.
    """
    path = Path(path)
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        part = _load_safetensors(file)
        duplicated = weights.keys() & part.keys()
        if duplicated:
            raise ValueError(f"{file} repeats tensor(s) of another shard: {sorted(duplicated)}")
        for name, tensor in part.items():
            cast = tensor.is_floating_point() and not KEEP_STORED_DTYPE.search(name)
            weights[name] = tensor.to(dtype) if cast else tensor
    index = path / INDEX_FILE
    if index.is_file():
        absent = read_index(index).keys() - weights.keys()
        if absent:
            raise ValueError(f"{INDEX_FILE} names tensors no shard holds: {sorted(absent)}")
    return weights


def copy_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill every parameter and buffer of `module`'s state dict from `tensors` by name;
    ValueError for a missing tensor or a shape that differs (extra tensors are ignored)."""
    own = module.state_dict()
    missing = [k for k in own if k not in tensors]
    if missing:
        raise ValueError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
    for name, param in own.items():
        src = tensors[name]
        if src.shape != param.shape:
            raise ValueError(f"weight {name}: shape {tuple(src.shape)}, "
                             f"model expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(src)


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({e}); the download or conversion "
            "is corrupt: replace the file (for SmolLM2 delete the cached folder to reconvert)"
        ) from e
