"""pdserve: disaggregated prefill/decode LLM serving.

The offline API is imported on first use, so `pdserve plan` and other torch-free commands start
without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.outputs import CompletionOutput, RequestOutput
    from pdserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "pdserve.llm",
    "SamplingParams": "pdserve.common.sampling_params",
    "RequestOutput": "pdserve.engine.outputs",
    "CompletionOutput": "pdserve.engine.outputs",
}


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
