"""`import nixl` for a venv that has only the `nixl-cu12` wheel.

vLLM's NixlConnector loads `nixl._api` and `nixl._bindings` (vllm/distributed/nixl_utils.py).
The module `nixl` comes from PyPI's `nixl` meta-package, which we do not install: it depends on
both CUDA variants. The `nixl-cu12` wheel (UCX inside, runs on CPU) ships the real code as
`nixl_cu12`, so this package re-exports it under the name vLLM asks for. serve.sh puts its parent
folder on PYTHONPATH of the disaggregated servers only.
"""

import importlib
import sys

from nixl import _api  # noqa: F401  (nixl/_api.py: nixl_cu12._api, maybe without progress thread)

for _name in ("_bindings", "_utils", "logging"):
    _mod = importlib.import_module(f"nixl_cu12.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _mod
    globals()[_name] = _mod

from nixl._api import *  # noqa: E402, F403  (nixl_agent, nixl_agent_config, ...)
