"""A `pdserve` command imports only its own command's module: `pdserve ctl` and `pdserve up`
start without the router's transformers (~1.3 s), a worker without the router or the benches.
Each check is a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ["transformers", "torch", "pdserve.router.app", "pdserve.bench.cli", "pdserve.cluster.up"]


def _loaded_after(argv: list[str]) -> list[str]:
    """The HEAVY modules loaded once `pdserve <argv>` has run (its --help exits)."""
    code = f"""
        import contextlib, io, sys
        from pdserve.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main({argv!r})
        print(",".join(m for m in {HEAVY!r} if m in sys.modules))
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return [m for m in res.stdout.strip().split(",") if m]


@pytest.mark.parametrize(("command", "loaded"), [
    ("ctl", []),
    ("up", ["pdserve.cluster.up"]),
    ("worker", []),
    ("router", ["transformers", "pdserve.router.app"]),
])
def test_a_command_loads_only_its_own_module(command: str, loaded: list[str]) -> None:
    assert _loaded_after([command, "--help"]) == loaded


def test_help_and_an_unknown_command_still_list_every_command() -> None:
    res = subprocess.run([sys.executable, "-m", "pdserve.cli", "no-such-command"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert ("invalid choice: 'no-such-command' (choose from 'generate', 'worker', 'router', "
            "'up', 'ctl', 'bench', 'plan', 'simulate', 'k8s', 'operator', 'testbed')"
            ) in res.stderr
