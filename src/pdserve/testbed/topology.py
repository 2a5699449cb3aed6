"""What a testbed is made of, by name: hosts, their namespaces, interfaces and addresses, and
the shape of a link.

Layout (every name starts with the testbed's prefix, so `down` finds all of it by prefix):
- namespace PREFIX + "switch" holds the bridge `br0`, one veth end `p-HOST` per host (its
  port on the bridge) and one ifb `i-HOST` per host (where what HOST sends is shaped: the
  port's ingress is redirected there);
- namespace PREFIX + HOST holds the other veth end, `eth0`, with the host's address, and `lo`.
Nothing is made in the machine's own namespace. Host i (in the order given) gets address
number FIRST_HOST + i of the subnet, a private IPv4 range that exists only inside the hosts.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace

DEFAULT_PREFIX = "pdtb-"
DEFAULT_SUBNET = "10.250.0.0/24"
SWITCH = "switch"  # the bridge's namespace; no host may have this name
BRIDGE = "br0"
HOST_LINK = "eth0"
FIRST_HOST = 10
MAX_GBPS = 400.0

_HOST = re.compile(r"^[a-z][a-z0-9]{0,11}$")  # port names p-HOST stay within 15 characters
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,15}-$")


@dataclass(frozen=True)
class LinkShape:
    """One host's link to the bridge. `gbps` limits each direction; a packet between two
    hosts crosses both their links, so between hosts with equal links the rate is `gbps`,
    the one-way delay `delay_ms` (each link adds half of its delay in each direction) and
    the round trip twice that; `loss_pct` percent of packets are dropped in each direction
    of the link (between two lossy hosts, both links drop)."""

    gbps: float = 10.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.gbps <= MAX_GBPS:
            raise ValueError(f"link rate must be in (0, {MAX_GBPS:g}] Gb/s, got {self.gbps:g}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"delay must be in [0, 10000] ms, got {self.delay_ms:g}")
        if not 0 <= self.jitter_ms <= self.delay_ms:
            raise ValueError(f"jitter must be in [0, delay] = [0, {self.delay_ms:g}] ms, got "
                             f"{self.jitter_ms:g}")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss must be a percentage in [0, 100], got {self.loss_pct:g}")

    @property
    def needs_delay(self) -> bool:
        """Delay and jitter need netem or the delay line (`delays.py`); rate and loss do not."""
        return self.delay_ms > 0 or self.jitter_ms > 0

    @property
    def bits_per_s(self) -> int:
        return round(self.gbps * 1e9)

    def changed(self, **values: float | None) -> LinkShape:
        """This shape with the values given (None: unchanged)."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def to_json(self) -> dict[str, float]:
        return {"gbps": self.gbps, "delay_ms": self.delay_ms, "jitter_ms": self.jitter_ms,
                "loss_pct": self.loss_pct}


@dataclass(frozen=True)
class Topology:
    """The hosts of one testbed and where they live. Hosts are unique, lower-case names of a
    letter then up to 11 letters or digits, never "switch"; the subnet is private IPv4 with
    room for every host."""

    hosts: tuple[str, ...]
    prefix: str = DEFAULT_PREFIX
    subnet: str = DEFAULT_SUBNET
    _network: ipaddress.IPv4Network = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("a testbed needs at least one host, e.g. --hosts router,p0,d0")
        bad = [h for h in self.hosts if not _HOST.match(h) or h == SWITCH]
        if bad:
            raise ValueError(f"host names must be a lower-case letter then up to 11 letters or "
                             f"digits, not {SWITCH!r}; bad: {', '.join(map(repr, bad))}")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"host names must be unique, got {','.join(self.hosts)}")
        if not _PREFIX.match(self.prefix):
            raise ValueError(f"prefix must be a lower-case letter, up to 15 letters or digits "
                             f"and a final '-', e.g. {DEFAULT_PREFIX!r}; got {self.prefix!r}")
        object.__setattr__(self, "_network", _private_network(self.subnet, len(self.hosts)))

    @property
    def switch_namespace(self) -> str:
        return self.prefix + SWITCH

    def namespace(self, host: str) -> str:
        self._check_host(host)
        return self.prefix + host

    def address(self, host: str) -> str:
        self._check_host(host)
        return str(self._network[FIRST_HOST + self.hosts.index(host)])

    @property
    def prefixlen(self) -> int:
        return self._network.prefixlen

    def _check_host(self, host: str) -> None:
        if host not in self.hosts:
            raise ValueError(f"no host {host!r} in this testbed (hosts: {', '.join(self.hosts)})")


def port_link(host: str) -> str:
    """The bridge's port to `host` (what leaves it goes to the host)."""
    return f"p-{host}"


def ifb_link(host: str) -> str:
    """Where what `host` sends is shaped, in the switch namespace."""
    return f"i-{host}"


def _private_network(subnet: str, hosts: int) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as e:
        raise ValueError(f"subnet {subnet!r} is not a network, e.g. {DEFAULT_SUBNET}: {e}") \
            from None
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        raise ValueError(f"subnet must be a private IPv4 range, e.g. {DEFAULT_SUBNET}; "
                         f"got {subnet}")
    if net.num_addresses - 1 <= FIRST_HOST + hosts:
        raise ValueError(f"subnet {subnet} has no room for {hosts} hosts from address "
                         f"number {FIRST_HOST}")
    return net
