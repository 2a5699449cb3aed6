"""Fake children for the supervisor tests: free ports, specs and a /proc liveness check."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pdserve.cluster.supervisor import ProcessSpec
from pdserve.cluster.up_process import free_port

FAKE_CHILD = Path(__file__).with_name("fake_child.py")


def fake_spec(name: str, *options: str) -> ProcessSpec:
    """A fake child named `name` on a free port, with fake_child.py `options`."""
    port = free_port()
    argv = (sys.executable, str(FAKE_CHILD), "--port", str(port), *options)
    return ProcessSpec(name, argv, f"http://127.0.0.1:{port}/health")


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (read from /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def gone_soon(pid: int, within_s: float = 3.0) -> bool:
    """True once `pid` stops running within `within_s` (orphans are reaped by init)."""
    deadline = time.monotonic() + within_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
