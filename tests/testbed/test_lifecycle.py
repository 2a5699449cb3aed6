"""`pdserve testbed up` / `down` / `run`: what up makes, that down removes all of it (processes
inside included), also what an `up` killed half-way left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from pdserve.testbed import lifecycle
from pdserve.testbed import namespaces as ns
from pdserve.testbed.namespaces import TestbedError
from pdserve.testbed.state import BedState, load
from pdserve.testbed.topology import LinkShape, Topology
from tests.testbed.conftest import assert_nothing_left, fresh_prefix, skip_without_namespaces

CLI = [sys.executable, "-m", "pdserve.cli", "testbed"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_up_makes_a_namespace_per_host_and_a_switch(make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(("router", "p0", "d0"))
    prefix = bed.topology.prefix
    assert ns.names(prefix) == sorted(prefix + h for h in ("d0", "p0", "router", "switch"))
    for host in bed.topology.hosts:
        (link,) = json.loads(ns.ip(bed.topology.namespace(host), "-j", "addr", "show", "dev",
                                   "eth0"))
        assert [a["local"] for a in link["addr_info"] if a["family"] == "inet"] == \
            [bed.topology.address(host)]
    assert load(prefix) == bed
    with pytest.raises(TestbedError, match=f"a testbed with prefix '{prefix}' exists"):
        lifecycle.up(bed.topology, LinkShape())


def test_run_executes_inside_a_host(make_bed: Callable[..., BedState]) -> None:
    bed = make_bed(("router", "p0"))
    done = _cli("run", "--prefix", bed.topology.prefix, "p0", "--", "ip", "-4", "-o", "addr",
                "show", "dev", "eth0")
    assert done.returncode == 0, done.stderr
    assert f"inet {bed.topology.address('p0')}/24" in done.stdout
    missing = _cli("run", "--prefix", bed.topology.prefix, "d7", "--", "true")
    assert missing.returncode == 1
    assert "no host 'd7'" in missing.stderr


def test_down_ends_the_processes_inside_and_leaves_nothing() -> None:
    skip_without_namespaces()
    prefix = fresh_prefix()
    try:
        bed = lifecycle.up(Topology(("p0", "d0"), prefix), LinkShape())
        sleeper = subprocess.Popen(ns.exec_argv(bed.topology.namespace("d0"), ["sleep", "60"]))
        done = _cli("down", "--prefix", prefix)
        assert done.returncode == 0, done.stderr
        assert f"removed 3 namespaces: {prefix}d0, {prefix}p0, {prefix}switch" in done.stdout
        assert sleeper.wait(10) == -signal.SIGTERM
        assert_nothing_left(prefix)
    finally:
        lifecycle.down(prefix)


def test_down_removes_what_a_killed_up_left_behind() -> None:
    skip_without_namespaces()
    prefix = fresh_prefix()
    hosts = ",".join(f"d{i}" for i in range(8))
    up = subprocess.Popen([*CLI, "up", "--prefix", prefix, "--hosts", hosts],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(ns.names(prefix)) < 2 and up.poll() is None:
            assert time.monotonic() < deadline, "up made no namespace"
            time.sleep(0.01)
        up.kill()
        up.wait(10)
        assert ns.names(prefix), "up finished before it could be killed half-way"
        done = _cli("down", "--prefix", prefix)
        assert done.returncode == 0, done.stderr
        assert_nothing_left(prefix)
    finally:
        up.kill()
        lifecycle.down(prefix)
