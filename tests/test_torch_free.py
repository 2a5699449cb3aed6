"""The router, the OpenAI API layer, the planner and the CLI's argument parsing run without torch:
a front-door host or a planning laptop need not load it. Each check is a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TORCH_FREE_MODULES = [
    "pdserve.router.app",
    "pdserve.api.openai_server",
    "pdserve.api.protocol",
    "pdserve.legs.frames",
    "pdserve.planner.plan",
    "pdserve.planner.simulate.cli",
    "pdserve.cli",
    "pdserve.transfer.auth",
    "pdserve.transfer.peer",
    "pdserve.transfer.layout",
    "pdserve.transfer.messages",
    "pdserve.internal_auth",
]

REPORT = "print('torch loaded' if 'torch' in sys.modules else 'torch-free')"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def _assert_torch_free(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "torch-free", res.stdout


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_import_does_not_load_torch(module: str) -> None:
    _assert_torch_free(_run(f"import sys\nimport {module}\n{REPORT}"))


def test_sampling_params_from_the_package_root_is_torch_free() -> None:
    _assert_torch_free(_run(f"import sys\nfrom pdserve import SamplingParams\n"
                            f"SamplingParams(max_tokens=3)\n{REPORT}"))


@pytest.mark.parametrize("command", ["plan", "simulate", "router", "worker", "up"])
def test_help_does_not_load_torch(command: str) -> None:
    res = _run(f"""
        import contextlib, io, sys
        from pdserve.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([{command!r}, "--help"])
        assert "usage: pdserve {command}" in out.getvalue(), out.getvalue()
        {REPORT}
    """)
    _assert_torch_free(res)


def test_router_loads_its_tokenizer_without_torch(tiny_model) -> None:
    folder: Path = tiny_model("qwen2")
    res = _run(f"""
        import sys
        from pdserve.router.app import Router, RouterSettings
        settings = RouterSettings(model={str(folder)!r}, collocated=("127.0.0.1:9",),
                                  secret=b"s" * 32)
        router = Router(settings)
        ids = router.api.tokenizer("The capital of France")["input_ids"]
        assert ids and all(isinstance(i, int) for i in ids), ids
        {REPORT}
    """)
    _assert_torch_free(res)
