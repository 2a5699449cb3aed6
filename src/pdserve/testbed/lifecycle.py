"""Build, change and remove a testbed (`topology.py` has the layout, `shaping.py` the trees).

`up` either leaves a whole testbed and its state file, or (on any failure, Ctrl-C included)
removes what it made. A process killed during `up` leaves namespaces behind: `down` finds
every namespace with the prefix and deletes it, ending the processes inside first, whether or
not the state file exists. Changes (`set_link`, `partition`, `heal`) apply to the running
links in place and rewrite the state file.
"""

from __future__ import annotations

from pdserve.testbed import delay_line, delays, shaping, state
from pdserve.testbed import namespaces as ns
from pdserve.testbed.namespaces import TestbedError
from pdserve.testbed.state import BedState, DelayMethod
from pdserve.testbed.topology import (
    BRIDGE,
    HOST_LINK,
    LinkShape,
    Topology,
    ifb_link,
    port_link,
)


def up(topology: Topology, shape: LinkShape) -> BedState:
    """Make the testbed: every host linked to the bridge with `shape`. TestbedError when one
    with this prefix exists, or the machine cannot (no root, no way to delay a link that must
    be delayed: `delays.py`)."""
    ns.check_can_build()
    existing = ns.names(topology.prefix)
    if existing:
        raise TestbedError(f"a testbed with prefix {topology.prefix!r} exists "
                           f"({', '.join(existing)}): pdserve testbed down first")
    try:
        bed = BedState(topology, {h: shape for h in topology.hosts}, _make_switch(topology))
        delays.check(bed)
        for host in topology.hosts:
            _make_host(bed, host)
        state.save(bed)
        delays.apply(bed)
        return bed
    except BaseException:
        down(topology.prefix)
        raise


def down(prefix: str) -> list[str]:
    """Delete every namespace named with `prefix` (processes inside ended first) and the
    state file; the namespaces deleted."""
    ns.check_can_build()
    found = ns.names(prefix)
    ns.delete(found)
    state.remove(prefix)
    for path in (delays.log_path(prefix), delay_line.applied_path(prefix)):
        path.unlink(missing_ok=True)  # the line's, if it ran (and was killed outright)
    return found


def set_link(prefix: str, host: str, **changes: float | None) -> BedState:
    """Change `host`'s link live (gbps, delay_ms, jitter_ms, loss_pct; None: unchanged)."""
    bed = state.load(prefix)
    shape = bed.links[_known(bed, host)].changed(**changes)
    delays.check(bed.with_link(host, shape))
    sw, netem = bed.topology.switch_namespace, bed.delay is DelayMethod.NETEM
    for dev in (port_link(host), ifb_link(host)):
        for cmd in shaping.reshape(dev, shape, netem):
            ns.tc(sw, *cmd)
    bed = bed.with_link(host, shape)
    _refilter(bed, host)
    state.save(bed)
    delays.apply(bed)
    return bed


def partition(prefix: str, a: str, b: str) -> BedState:
    """Drop every IPv4 packet between hosts `a` and `b` (both ways) until `heal`."""
    bed = state.load(prefix)
    pair = tuple(sorted((_known(bed, a), _known(bed, b))))
    if pair[0] == pair[1]:
        raise ValueError(f"a partition is between two hosts, got {a} twice")
    return _set_partitions(bed, bed.partitions | {pair})


def heal(prefix: str, a: str | None = None, b: str | None = None) -> BedState:
    """End the partition between `a` and `b`, or with neither given every partition."""
    bed = state.load(prefix)
    if (a is None) != (b is None):
        raise ValueError("heal takes two hosts, or none for every partition")
    keep = frozenset() if a is None else bed.partitions - {tuple(sorted((a, b)))}
    return _set_partitions(bed, keep)


def _set_partitions(bed: BedState, partitions: frozenset[tuple[str, str]]) -> BedState:
    touched = {h for pair in bed.partitions ^ partitions for h in pair}
    bed = bed.with_partitions(partitions)
    for host in sorted(touched):
        _refilter(bed, host)
    state.save(bed)
    return bed


def _known(bed: BedState, host: str) -> str:
    bed.topology.address(host)  # ValueError naming the hosts there are
    return host


def _make_switch(topology: Topology) -> DelayMethod:
    """The switch namespace with its bridge up; how its links can delay."""
    sw = topology.switch_namespace
    ns.add(sw)
    ns.ip(sw, "link", "add", BRIDGE, "type", "bridge")
    ns.ip(sw, "link", "set", BRIDGE, "up")
    return delays.probe(sw)


def _make_host(bed: BedState, host: str) -> None:
    topology, shape, netem = bed.topology, bed.links[host], bed.delay is DelayMethod.NETEM
    sw, inside = topology.switch_namespace, topology.namespace(host)
    port, ifb = port_link(host), ifb_link(host)
    ns.add(inside)
    ns.ip(sw, "link", "add", port, "type", "veth", "peer", "name", HOST_LINK, "netns", inside)
    ns.ip(sw, "link", "set", port, "master", BRIDGE)
    ns.ip(sw, "link", "add", ifb, "type", "ifb")
    for dev in (port, ifb):
        ns.ip(sw, "link", "set", dev, "up")
    ns.ip(inside, "addr", "add", f"{topology.address(host)}/{topology.prefixlen}", "dev",
          HOST_LINK)
    ns.ip(inside, "link", "set", HOST_LINK, "up")
    cmds = [*shaping.redirect_ingress(port, ifb), *shaping.tree(port, shape, netem),
            *shaping.tree(ifb, shape, netem), *shaping.filters(port, shape.loss_pct),
            *shaping.filters(ifb, shape.loss_pct)]
    for cmd in cmds:
        ns.tc(sw, *cmd)


def _refilter(bed: BedState, host: str) -> None:
    """Rewrite `host`'s filters: its loss both ways, and what it sends to the hosts it is cut
    from dropped (the partition's other direction is on the other host's link)."""
    sw, loss = bed.topology.switch_namespace, bed.links[host].loss_pct
    cut = tuple(bed.topology.address(h) for h in bed.cut_from(host))
    for dev, dsts in ((port_link(host), ()), (ifb_link(host), cut)):
        for cmd in shaping.clear_filters(dev):
            ns.tc(sw, *cmd, check=False)
        for cmd in shaping.filters(dev, loss, dsts):
            ns.tc(sw, *cmd)
