"""A testbed's state file: STATE_DIR/NAME.json (NAME: the prefix without its "-"), written by
`up`, `link`, `partition` and `heal`, removed by `down`.

It holds what the namespaces do not say simply: the hosts in order with their addresses, each
link's shape, the partitioned host pairs and how its links delay (`DelayMethod`). The
namespaces are the truth for what exists (`down` works from them alone, with or without this
file).

    {"prefix": "pdtb-", "subnet": "10.250.0.0/24", "delay": "queue",
     "hosts": {"router": "10.250.0.10", "p0": "10.250.0.11", "d0": "10.250.0.12"},
     "links": {"p0": {"gbps": 10.0, "delay_ms": 0.0, "jitter_ms": 0.0, "loss_pct": 0.0}, ...},
     "partitions": [["d0", "p0"]]}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from pdserve.testbed.namespaces import TestbedError
from pdserve.testbed.topology import LinkShape, Topology

STATE_DIR = Path("/run/pdserve-testbed")


class DelayMethod(StrEnum):
    """How a testbed's links delay and jitter, the first the machine has (`delays.probe`)."""

    NETEM = "netem"  # the kernel's netem qdisc under each link's rate (shaping.py)
    QUEUE = "queue"  # delay_line.py: user space, packets held in an NFQUEUE (iptables)
    NONE = "none"  # neither: links have rate and loss only


@dataclass(frozen=True)
class BedState:
    """A built testbed: its topology, every host's link, the partitioned pairs (each sorted,
    both hosts in the topology)."""

    topology: Topology
    links: dict[str, LinkShape] = field(hash=False)
    delay: DelayMethod = DelayMethod.NONE
    partitions: frozenset[tuple[str, str]] = frozenset()

    def __post_init__(self) -> None:
        if set(self.links) != set(self.topology.hosts):
            raise ValueError("a testbed state needs one link per host")
        for a, b in self.partitions:
            if not (a < b and {a, b} <= set(self.topology.hosts)):
                raise ValueError(f"bad partition {a}|{b}: two hosts of the testbed, sorted")

    def with_link(self, host: str, shape: LinkShape) -> BedState:
        self.topology.address(host)  # ValueError for a host not in the testbed
        return replace(self, links={**self.links, host: shape})

    def with_partitions(self, partitions: frozenset[tuple[str, str]]) -> BedState:
        return replace(self, partitions=partitions)

    def cut_from(self, host: str) -> tuple[str, ...]:
        """The hosts `host` is partitioned from."""
        return tuple(sorted({b if a == host else a for a, b in self.partitions
                             if host in (a, b)}))

    def to_json(self) -> dict:
        t = self.topology
        return {"prefix": t.prefix, "subnet": t.subnet, "delay": self.delay.value,
                "hosts": {h: t.address(h) for h in t.hosts},
                "links": {h: self.links[h].to_json() for h in t.hosts},
                "partitions": sorted(map(list, self.partitions))}

    @classmethod
    def from_json(cls, data: dict) -> BedState:
        topology = Topology(tuple(data["hosts"]), data["prefix"], data["subnet"])
        return cls(topology, {h: LinkShape(**s) for h, s in data["links"].items()},
                   DelayMethod(data["delay"]), frozenset(tuple(p) for p in data["partitions"]))


def state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix.rstrip('-')}.json"


def save(state: BedState) -> None:
    STATE_DIR.mkdir(mode=0o755, exist_ok=True)
    write_atomic(state_path(state.topology.prefix), json.dumps(state.to_json(), indent=1) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """A reader sees the old file or the new one, never part of it."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def load(prefix: str) -> BedState:
    """TestbedError when there is no testbed with this prefix (or its file is unreadable)."""
    path = state_path(prefix)
    try:
        return BedState.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise TestbedError(f"no testbed with prefix {prefix!r} ({path} does not exist): "
                           "pdserve testbed up first") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TestbedError(f"{path} is unreadable ({e}): pdserve testbed down, then up "
                           "again") from None


def remove(prefix: str) -> bool:
    """Delete the state file; whether there was one."""
    try:
        state_path(prefix).unlink()
        return True
    except FileNotFoundError:
        return False
