"""`UpProcess`, the `pdserve up` child of the benchmarks: a caller killed outright (a bench
under `timeout`, or SIGKILL) takes its cluster with it, instead of leaving a router and
workers on the cores and ports of the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

GONE_S = 30.0  # up's own stop: SIGTERM to each worker, their grace, then the router

CALLER = """
import sys, time
from pdserve.cluster.up_process import UpProcess
up = UpProcess(sys.argv[1], "--collocated", "1", "--cpus", "0")
print(up.proc.pid, *(p for p in up.pids() if p != up.proc.pid), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (the orphans' parent may not reap here)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_killed_caller_takes_its_cluster_with_it(tiny_model: Callable[..., Path]) -> None:
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(tiny_model())],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = caller.stdout.readline()
        assert line, "the caller exited before its cluster was ready"
        pids = [int(p) for p in line.split()]
        assert len(pids) >= 3 and all(_alive(p) for p in pids)  # up, a worker, the router
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(10)
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed caller's cluster still running: {left}"
