"""A network namespace joined to this one by a veth pair: a second host for transfer tests.

Needs root (CAP_NET_ADMIN) and iproute2; without them the test using it is skipped. Names and
the /30 subnet come from the process id, so concurrent test runs do not collide; the namespace
(and with it both veth ends) is deleted on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Namespace:
    name: str
    outside: str  # this host's address on the veth pair
    inside: str  # the namespace's address
    inner_link: str

    def cut(self) -> None:
        """The namespace's link goes down: its host stops answering, with no reset or FIN."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.inner_link, "down")

    def mend(self) -> None:
        """The link comes back up (after `cut`): the host answers again."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.inner_link, "up")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def network_namespace() -> Iterator[Namespace]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    pid = os.getpid()
    name, host_link, inner_link = f"pdt{pid}", f"pdt{pid % 10**8}h", f"pdt{pid % 10**8}c"
    third, fourth = pid % 250, 4 * (pid // 250 % 60)  # the /30 10.231.third.fourth
    outside, inside = f"10.231.{third}.{fourth + 1}", f"10.231.{third}.{fourth + 2}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.strip()}")
    try:
        _ip("link", "add", host_link, "type", "veth", "peer", "name", inner_link)
        _ip("link", "set", inner_link, "netns", name)
        _ip("addr", "add", f"{outside}/30", "dev", host_link)
        _ip("link", "set", host_link, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{inside}/30", "dev", inner_link)
        _ip("netns", "exec", name, "ip", "link", "set", inner_link, "up")
        yield Namespace(name, outside, inside, inner_link)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)
