"""Network namespaces through iproute2: make, list by prefix, delete, run in, enter.

Every command is `ip` or `tc` (iproute2), run to completion; a failure raises `TestbedError`
with the command and its error text. `entered` moves only the calling thread into a namespace
(setns(2)) and back: sockets it opens meanwhile stay in that namespace for their lifetime.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")  # where `ip netns add` binds a namespace by name
_CLONE_NEWNET = 0x40000000
_TERM_GRACE_S = 5.0


class TestbedError(RuntimeError):
    """The machine cannot do what was asked (no root, no iproute2, a command failed)."""

    __test__ = False  # not a pytest test class


def check_can_build() -> None:
    """TestbedError unless this process may create namespaces and has `ip` and `tc`."""
    if os.geteuid() != 0:
        raise TestbedError("pdserve testbed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to "
                           "create network namespaces: run it with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedError(f"pdserve testbed needs iproute2's {' and '.join(missing)} on PATH "
                           "(Debian/Ubuntu: apt-get install iproute2)")


def run(argv: Sequence[str], *, check: bool = True) -> str:
    """Run `argv`; its stdout. With `check`, TestbedError when it fails."""
    done = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def ip(namespace: str | None, *args: str, check: bool = True) -> str:
    """`ip [-n NAMESPACE] ARGS...`."""
    where = ["-n", namespace] if namespace else []
    return run(["ip", *where, *args], check=check)


def tc(namespace: str, *args: str, check: bool = True) -> str:
    """`tc ARGS...` inside `namespace`."""
    return run(exec_argv(namespace, ["tc", *args]), check=check)


def exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs `argv` inside `namespace`."""
    return ["ip", "netns", "exec", namespace, *argv]


def add(namespace: str) -> None:
    """A new namespace with its loopback up."""
    ip(None, "netns", "add", namespace)
    ip(namespace, "link", "set", "lo", "up")


def names(prefix: str) -> list[str]:
    """Every namespace whose name starts with `prefix`, sorted."""
    listed = json.loads(ip(None, "-j", "netns", "list") or "[]")
    return sorted(n["name"] for n in listed if n["name"].startswith(prefix))


def delete(found: Sequence[str]) -> None:
    """End the processes inside the namespaces `found` (SIGTERM to all, SIGKILL to those left
    after a grace), then delete the namespaces (their interfaces with them: a veth's other end
    in another namespace goes too)."""
    _end_processes(found)
    for namespace in found:
        ip(None, "netns", "del", namespace, check=False)


def _end_processes(found: Sequence[str]) -> None:
    pids = pids_in(found)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = pids_in(found)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pids_in(found: Sequence[str]) -> set[int]:
    """The processes inside the namespaces, this one excepted."""
    pids = {int(p) for namespace in found
            for p in ip(None, "netns", "pids", namespace, check=False).split()}
    return pids - {os.getpid()}


@contextlib.contextmanager
def entered(namespace: str) -> Iterator[None]:
    """The calling thread inside `namespace` for the block, then back where it was."""
    with open("/proc/thread-self/ns/net", "rb") as home, \
            open(NETNS_DIR / namespace, "rb") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


def enter_for_good(namespace: str) -> None:
    """This thread, and every thread it starts afterwards, inside `namespace`. Call it from
    the main thread before any other starts: threads started earlier stay where they were."""
    with open(NETNS_DIR / namespace, "rb") as target:
        _setns(target.fileno())


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise TestbedError(f"setns into a network namespace failed: {os.strerror(err)}")
