"""What a fresh process pays to load a model and to find the CPU operators: building the model
on the meta device and moving it to its device import neither torch._dynamo (~1.3 s) nor sympy
(~0.6 s), and `python -m pdserve.engine.kernels` names the finished build it loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pdserve.engine import kernels


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=300)


def test_loading_a_model_imports_neither_dynamo_nor_sympy(tiny_model) -> None:
    for arch in ("llama", "qwen3_moe", "deepseek_v3"):
        res = _python("""
            import sys
            from pathlib import Path
            import torch
            from pdserve.common.model_config import ModelConfig
            from pdserve.engine.model.loader import load_model
            path = Path(sys.argv[1])
            load_model(path, ModelConfig.from_folder(path), torch.float32, "cpu", 256)
            print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
        """, str(tiny_model(arch)))
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "[]", arch


def test_the_build_command_names_the_build_it_loaded(ops) -> None:
    res = subprocess.run([sys.executable, "-m", "pdserve.engine.kernels"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0
    assert res.stderr.strip().splitlines()[-1] == f"pdserve's CPU operators: {kernels.build_dir()}"
