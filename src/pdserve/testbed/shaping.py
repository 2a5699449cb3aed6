"""The `tc` commands that shape one direction of a link (pure: argument lists, no effects).

Each shaped device (a host's bridge port for what goes to the host, its ifb for what the host
sends) has the same tree, all of it in the switch namespace, so drops happen in the "network",
never in the sending host's own stack (a local qdisc drop is reported to the sender's TCP,
which a real network never does):

    htb 1: (default 1:10)
      1:10  rate = ceil = the link's rate -> leaf 10: bfifo (byte queue), or netem when the
            kernel has it and the link has delay or jitter (half of each per direction)
      1:20  the drop class -> leaf 20: pfifo limit 0 (every packet dropped)
    filters into 1:20: prio 1, u32 on destination addresses (partitions); prio 2, a classic
    BPF program on a random number (loss), so loss needs no netem.

The kernel's netem is optional (some kernels are built without it): only delay and jitter
need it, and without it the delay line (`delay_line.py`) holds the packets instead. Queues:
QUEUE_S of the link's rate in bytes, at least MIN_QUEUE_BYTES.
"""

from __future__ import annotations

import math

from pdserve.testbed.topology import LinkShape

QUEUE_S = 0.005
MIN_QUEUE_BYTES = 256 * 1024
MIN_BURST_BYTES = 128 * 1024  # above one 64 KiB GSO segment
BURST_S = 0.001
QUANTUM = 70_000  # bytes a class may send per round; above one GSO segment
PACKET_BYTES = 1514
_SKF_AD_RANDOM = 0xFFFFF000 + 56  # classic BPF: load a random 32-bit number
_PASS, _MATCH = 0, 0xFFFFFFFF  # cls_bpf: 0 = no match, -1 = the filter's class (1:20)

Command = list[str]


def tree(dev: str, shape: LinkShape, netem: bool = False) -> list[Command]:
    """Build the tree on `dev` (which has none yet); `netem`: the delay is netem's."""
    rate = f"{shape.bits_per_s}bit"
    return [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", *_htb(shape)],
        ["qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", *leaf(shape, netem)],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate,
         "quantum", str(QUANTUM)],
        ["qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0"],
    ]


def reshape(dev: str, shape: LinkShape, netem: bool = False) -> list[Command]:
    """Change the rate and the leaf of a built tree in place (traffic keeps flowing)."""
    return [["class", "change", "dev", dev, "parent", "1:", "classid", "1:10", *_htb(shape)],
            ["qdisc", "replace", "dev", dev, "parent", "1:10", "handle", "10:",
             *leaf(shape, netem)]]


def clear_filters(dev: str) -> list[Command]:
    """Remove the loss and partition filters (run unchecked: there may be none)."""
    return [["filter", "del", "dev", dev, "parent", "1:", "prio", prio] for prio in ("1", "2")]


def filters(dev: str, loss_pct: float, dropped_dsts: tuple[str, ...] = ()) -> list[Command]:
    """Drop every IPv4 packet to `dropped_dsts`, and `loss_pct` percent of all the others."""
    cmds = [["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{dst}/32", "flowid", "1:20"] for dst in dropped_dsts]
    if loss_pct > 0:
        cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio",
                     "2", "bpf", "bytecode", loss_bytecode(loss_pct), "classid", "1:20"])
    return cmds


def redirect_ingress(port: str, ifb: str) -> list[Command]:
    """Send everything arriving at `port` (what its host sends) through `ifb`'s egress."""
    return [["qdisc", "add", "dev", port, "handle", "ffff:", "ingress"],
            ["filter", "add", "dev", port, "parent", "ffff:", "protocol", "all", "u32", "match",
             "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", ifb]]


def probe_netem(dev: str) -> list[Command]:
    """Add, then remove, a netem root on `dev`: whether the kernel has netem."""
    return [["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", "1ms"],
            ["qdisc", "del", "dev", dev, "root"]]


def leaf(shape: LinkShape, netem: bool = False) -> Command:
    """The queue under the rate limit, for one direction (with `netem`, half the link's delay
    and jitter)."""
    rate_bytes = shape.bits_per_s / 8
    queue = max(MIN_QUEUE_BYTES, math.ceil(rate_bytes * QUEUE_S))
    if not (netem and shape.needs_delay):
        return ["bfifo", "limit", str(queue)]
    held_s = (shape.delay_ms + shape.jitter_ms) / 2000
    packets = max(1000, math.ceil((queue + rate_bytes * held_s) / PACKET_BYTES))
    jitter = [_us(shape.jitter_ms / 2)] if shape.jitter_ms > 0 else []
    return ["netem", "delay", _us(shape.delay_ms / 2), *jitter, "limit", str(packets)]


def loss_bytecode(loss_pct: float) -> str:
    """A classic BPF program (tc's `bytecode` text) that matches `loss_pct` percent of packets
    at random: A = random; if A >= threshold: no match; else match."""
    if loss_pct >= 100:
        return f"1,6 0 0 {_MATCH}"
    threshold = max(1, round(loss_pct / 100 * 2**32))
    return (f"4,32 0 0 {_SKF_AD_RANDOM},53 0 1 {threshold},"
            f"6 0 0 {_PASS},6 0 0 {_MATCH}")


def _htb(shape: LinkShape) -> Command:
    rate = f"{shape.bits_per_s}bit"
    burst = str(max(MIN_BURST_BYTES, math.ceil(shape.bits_per_s / 8 * BURST_S)))
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
            "quantum", str(QUANTUM)]


def _us(ms: float) -> str:
    return f"{round(ms * 1000)}us"
