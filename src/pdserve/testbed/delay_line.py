"""A testbed's link delay and jitter in user space, for kernels without netem.

Where the kernel has no netem qdisc, one process in the switch namespace (`python -m
pdserve.testbed.delay_line PREFIX`) holds every packet crossing the bridge for as long as the
links it crosses say: the bridge hands IPv4 packets to iptables (br_netfilter), one rule
(`FORWARD -j NFQUEUE --queue-bypass`, which this process adds once bound and removes when it
ends) queues them, and this process gives each its verdict when its time comes (nfqueue.py).

What a packet from host A to host B waits (the netem model of `shaping.py`, half of each
link's delay and jitter per direction, so between equal links the one-way delay is the
link's `delay_ms`):

    wait = dA / 2 + dB / 2 + uniform(-jA / 2, jA / 2) + uniform(-jB / 2, jB / 2)

It sits between the two rate limits: A's (the ifb, before the bridge) and B's (its port,
after). Unlike netem with jitter, packets from A to B leave in the order they came (a packet
never leaves before the one ahead of it: its release is at least that one's), as on a real
path, so jitter shows as delay variation, not reordering. Loss and partitions stay in `tc`.

Lifetime: started by `lifecycle` when a link first needs a delay, it re-reads the testbed's
state file when it changes (within POLL_S), says which state it applies in the file
`applied_path` (the state's mtime in ns, for `lifecycle` to wait on), and ends (its rule
removed) when no link needs a delay any more, when the state file goes (`down`), or on
SIGTERM (`down` ends the processes in the namespaces). Killed outright, it leaves its rule,
whose --queue-bypass then lets packets through undelayed.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pdserve.testbed import namespaces as ns
from pdserve.testbed import nfqueue, state
from pdserve.testbed.nfqueue import Packet
from pdserve.testbed.topology import LinkShape, port_link

QUEUE = 0  # the netfilter queue number (queues are per namespace)
POLL_S = 0.02  # how often the state file is checked for changes
RULE = ["FORWARD", "-j", "NFQUEUE", "--queue-num", str(QUEUE), "--queue-bypass"]
IPTABLES = ("iptables-legacy", "iptables")  # NFQUEUE through xtables, legacy first


def applied_path(prefix: str) -> Path:
    return state.state_path(prefix).with_suffix(".delay")


class Schedule:
    """When each packet leaves: `release_s` by the module docstring's formula, never before the
    last packet released on the same (in port, out port) path."""

    def __init__(self, rng: Callable[[], float] = random.random) -> None:
        self.rng = rng  # uniform in [0, 1)
        self._last: dict[tuple[int, int], float] = {}

    def release_s(self, now: float, packet: Packet, shapes: Mapping[int, LinkShape]) -> float:
        wait = sum(self._half(shapes.get(port)) for port in (packet.in_port, packet.out_port))
        path = (packet.in_port, packet.out_port)
        at = max(now + wait, self._last.get(path, 0.0))
        self._last[path] = at
        return at

    def _half(self, shape: LinkShape | None) -> float:
        """Half of one link's delay, with half its jitter drawn uniformly, in seconds."""
        if shape is None:
            return 0.0
        jitter = (2 * self.rng() - 1) * shape.jitter_ms / 2
        return max(0.0, shape.delay_ms / 2 + jitter) / 1e3


def needs_delay(bed: state.BedState) -> bool:
    return any(s.needs_delay for s in bed.links.values())


def port_shapes(bed: state.BedState) -> dict[int, LinkShape]:
    """Each host's link by the ifindex of its bridge port (in this process's namespace)."""
    index = {name: i for i, name in socket.if_nameindex()}
    return {index[port_link(h)]: shape for h, shape in bed.links.items()
            if port_link(h) in index}


def iptables(*args: str, namespace: str | None = None) -> None:
    """`iptables ARGS` (inside `namespace`, else here) with the first of IPTABLES that runs it
    clean; OSError when none does. `delays.probe` and the line itself both choose this way."""
    errors = []
    for tool in filter(shutil.which, IPTABLES):
        argv = [tool, *args]
        done = subprocess.run(argv if namespace is None else ns.exec_argv(namespace, argv),
                              capture_output=True, text=True)
        if done.returncode == 0:
            return
        errors.append(f"{tool}: {done.stderr.strip()}")
    raise OSError(f"iptables {' '.join(args)} failed: {'; '.join(errors) or 'none on PATH'}")


class DelayLine:
    """Packets held (`held`, a heap by release time) from their read until their verdict;
    every one still held is accepted when `run` ends, so none stays in the kernel's queue."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.queue = nfqueue.Queue(QUEUE, blocking=False)
        self.schedule = Schedule()
        self.held: list[tuple[float, int, int]] = []  # (release_s, arrival order, packet id)
        self.count = 0
        self.seen_ns = -1
        self.shapes: dict[int, LinkShape] = {}
        self.stopping = False

    def reload(self) -> bool:
        """Re-read the state file if it changed; False when the line should end."""
        path = state.state_path(self.prefix)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime != self.seen_ns:
            bed = state.load(self.prefix)
            if not needs_delay(bed):
                return False
            self.shapes, self.seen_ns = port_shapes(bed), mtime
            state.write_atomic(applied_path(self.prefix), str(mtime))
        return True

    def take(self, now: float) -> None:
        """Schedule every packet the kernel has queued to us since the last read."""
        while True:
            try:
                batch = self.queue.read()
            except BlockingIOError:
                return
            except OSError as e:  # ENOBUFS: announcements lost; their packets wait until the
                # line ends (TCP sends them again meanwhile)
                if e.errno != errno.ENOBUFS:
                    raise
                continue
            for p in batch:
                heapq.heappush(self.held, (self.schedule.release_s(now, p, self.shapes),
                                           self.count, p.packet_id))
                self.count += 1

    def release(self, now: float) -> None:
        due = []
        while self.held and self.held[0][0] <= now:
            due.append(heapq.heappop(self.held)[2])
        if due:
            self.queue.accept(due)

    def run(self, clock: Callable[[], float]) -> None:
        next_poll = 0.0
        while not self.stopping:
            now = clock()
            if now >= next_poll:
                if not self.reload():
                    break
                next_poll = now + POLL_S
            wake = min(next_poll, self.held[0][0] if self.held else next_poll)
            ready, _, _ = select.select([self.queue], [], [], max(0.0, wake - now))
            now = clock()
            if ready:
                self.take(now)
            self.release(now)
        self.release(float("inf"))  # nothing held back at the end


def main(argv: list[str]) -> int:
    prefix = argv[0]
    line = DelayLine(prefix)
    signal.signal(signal.SIGTERM, lambda *_: setattr(line, "stopping", True))
    with contextlib.suppress(PermissionError):
        os.nice(-10)  # wake on time beside busy workers
    iptables("-A", *RULE)
    try:
        line.run(time.monotonic)
    finally:
        with contextlib.suppress(OSError):
            iptables("-D", *RULE)
        with contextlib.suppress(FileNotFoundError):
            applied_path(prefix).unlink()
        line.queue.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
