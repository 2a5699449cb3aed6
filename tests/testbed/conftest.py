"""Testbeds for tests: each with a prefix of its own (this process's id and a counter), so a
user's testbed and concurrent runs are never touched, and removed after the test, passed or
failed, with a check that nothing of it is left.

Tests that need namespaces skip, saying why, where this process is not root, iproute2 is
missing, or the kernel refuses a namespace.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

from pdserve.testbed import lifecycle, state
from pdserve.testbed import namespaces as ns
from pdserve.testbed.state import BedState
from pdserve.testbed.topology import LinkShape, Topology

_count = itertools.count()


def skip_without_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("the testbed needs root to create network namespaces")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("the testbed needs iproute2's ip and tc")
    probe = f"pdtp{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"this machine cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def fresh_prefix() -> str:
    return f"pdt{os.getpid()}x{next(_count)}-"


def assert_nothing_left(prefix: str) -> None:
    assert ns.names(prefix) == []
    path = state.state_path(prefix)
    assert [p.name for p in path.parent.glob(path.stem + ".*")] == []  # the delay line's too


@pytest.fixture
def make_bed() -> Iterator[Callable[..., BedState]]:
    """make_bed(hosts, shape=LinkShape()) -> a testbed, removed at the end of the test."""
    skip_without_namespaces()
    made: list[str] = []

    def make(hosts: tuple[str, ...], shape: LinkShape | None = None) -> BedState:
        prefix = fresh_prefix()
        made.append(prefix)
        return lifecycle.up(Topology(hosts, prefix), shape or LinkShape())

    try:
        yield make
    finally:
        for prefix in made:
            lifecycle.down(prefix)
            assert_nothing_left(prefix)
