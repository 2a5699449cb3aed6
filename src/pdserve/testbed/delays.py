"""How a testbed's links get their delay and jitter, and keeping the delay line in step.

`probe` picks the first the machine has (state.DelayMethod): the kernel's netem qdisc (each
link's leaf, shaping.py), else the delay line (delay_line.py: user space over NFQUEUE, which
needs iptables and the kernel's NFQUEUE target), else none (then a delay is refused).

With the delay line, `apply` runs after every change of the state file: while some link needs
a delay the line must be running in the switch namespace, and it returns once the line applies
the new state (so a changed link is in effect when `pdserve testbed link` returns); the line
ends by itself when no link needs one.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

from pdserve.testbed import delay_line, shaping, state
from pdserve.testbed import namespaces as ns
from pdserve.testbed.namespaces import TestbedError
from pdserve.testbed.state import BedState, DelayMethod

START_S = 10.0  # for the line to bind and add its rule, or to apply a new state
RESTART_S = 2.0
_MODULE = "pdserve.testbed.delay_line"

NO_DELAY = ("this machine can delay no link: the kernel has no netem qdisc "
            "(CONFIG_NET_SCH_NETEM) and the user-space delay line needs iptables with the "
            "kernel's NFQUEUE target (Debian/Ubuntu: apt-get install iptables); give "
            "--delay-ms 0 --jitter-ms 0 (rate and loss work without either)")


def probe(switch: str) -> DelayMethod:
    """The method the switch namespace `switch` (just made, no rules) can use."""
    add, remove = shaping.probe_netem("lo")
    ns.tc(switch, *add, check=False)  # fails where the kernel has no netem
    if "qdisc netem 1: root" in ns.tc(switch, "qdisc", "show", "dev", "lo"):
        ns.tc(switch, *remove)
        return DelayMethod.NETEM
    try:
        delay_line.iptables("-A", *delay_line.RULE, namespace=switch)
    except OSError:
        return DelayMethod.NONE
    delay_line.iptables("-D", *delay_line.RULE, namespace=switch)
    return DelayMethod.QUEUE


def check(bed: BedState) -> None:
    """TestbedError when a link needs a delay this testbed cannot give."""
    if delay_line.needs_delay(bed) and bed.delay is DelayMethod.NONE:
        raise TestbedError(NO_DELAY)


def apply(bed: BedState) -> None:
    """After `bed` was saved: the delay line running and applying it, where it is needed."""
    if bed.delay is not DelayMethod.QUEUE or not delay_line.needs_delay(bed):
        return
    prefix, switch = bed.topology.prefix, bed.topology.switch_namespace
    want = state.state_path(prefix).stat().st_mtime_ns
    deadline, started = time.monotonic() + START_S, -math.inf
    while _applied(prefix) != want:
        now = time.monotonic()
        if now > deadline:
            raise TestbedError(f"the delay line did not take the new link shapes within "
                               f"{START_S:g} s (its log: {log_path(prefix)})")
        # not running (or ended meanwhile: the last change had no delay): start one, again
        # only after RESTART_S, since one that just started may not be listed yet
        if now - started > RESTART_S and not running(switch):
            _start(bed)
            started = now
        time.sleep(0.01)


def running(switch: str) -> bool:
    """Whether a delay line process runs in the namespace `switch`."""
    for pid in ns.pids_in([switch]):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if _MODULE.encode() in cmdline:
            return True
    return False


def log_path(prefix: str) -> Path:
    return state.state_path(prefix).with_suffix(".delay.log")


def _start(bed: BedState) -> None:
    """The line, in its own session so it outlives this command (`down` ends it)."""
    prefix = bed.topology.prefix
    with open(log_path(prefix), "ab") as log:
        subprocess.Popen(ns.exec_argv(bed.topology.switch_namespace,
                                      [sys.executable, "-m", _MODULE, prefix]),
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True)


def _applied(prefix: str) -> int | None:
    try:
        return int(delay_line.applied_path(prefix).read_text())
    except (FileNotFoundError, ValueError):
        return None
