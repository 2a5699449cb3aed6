"""Shared fixtures: tiny random-weight models and their Hugging Face reference outputs."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pdserve.testing.tiny_models import write_tiny_model

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine

torch.set_num_threads(min(2, torch.get_num_threads()))
if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter without a GPU (read when Triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """tiny_model(arch="llama", **overrides) -> folder, written once per argument set."""

    made: dict[str, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True)
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return made[key]

    return make


# The KV pool of a test engine whose pool size is not what the test is about: 512 blocks, room
# for 32 whole 256-token contexts. The default (512 MiB: 65,536 blocks of the tiny model) is
# zeroed and listed block by block at each construction, for room no test uses.
KV_BLOCKS = 512


def tiny_engine(path: Path, role: str, num_kv_blocks: int, device: str = "cpu") -> Engine:
    """An engine of `role` on a tiny model, fp32, 256-token context, `num_kv_blocks` blocks."""
    from pdserve.config import EngineConfig, Role
    from pdserve.engine.engine import Engine

    return Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=256,
                               device=device, role=Role(role), num_kv_blocks=num_kv_blocks))


def engine_pair(path: Path, decode_blocks: int = 64, device: str = "cpu"
                ) -> tuple[Engine, Engine]:
    """A prefill-role and a decode-role engine on the same tiny model, fp32, 256-token context."""
    return (tiny_engine(path, "prefill", KV_BLOCKS, device),
            tiny_engine(path, "decode", decode_blocks, device))


@functools.cache
def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, ignoring EOS."""
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=None, eos_token_id=None,
        )
    return out[0, len(prompt):].tolist()


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' fp32 logits for every position of `prompt`: [len, vocab]."""
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([prompt])).logits[0]
