"""`pdserve up` as a user runs it: one command, then SIGTERM (or Ctrl-C) leaves nothing."""

from __future__ import annotations

import os
import signal

import pytest

from tests.serve.cluster import Cluster


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_router_and_workers_with_nothing_left(tiny_model, stop_signal) -> None:
    cluster = Cluster(tiny_model(), "--transport", "tcp")
    try:
        children = [p for p in cluster.pids() if p != cluster.proc.pid]
        assert len(children) == 3  # prefill, decode, router
        assert {cluster.health(i)["pid"] for i in (0, 1)} <= set(children)
        os.kill(cluster.proc.pid, stop_signal)
        assert cluster.proc.wait(30) == 0
        assert not [p for p in children if _alive(p)]
        assert any("stopped" in line for line in cluster.log)
    finally:
        cluster.stop()
