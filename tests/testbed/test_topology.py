"""A testbed's names, addresses, link shapes, tc commands and state file, without namespaces."""

from __future__ import annotations

import pytest

from pdserve.testbed import namespaces, shaping
from pdserve.testbed.namespaces import TestbedError
from pdserve.testbed.state import BedState, DelayMethod
from pdserve.testbed.topology import LinkShape, Topology


def test_hosts_get_private_addresses_in_order_and_prefixed_namespaces() -> None:
    t = Topology(("router", "p0", "d0"))
    assert [t.address(h) for h in t.hosts] == ["10.250.0.10", "10.250.0.11", "10.250.0.12"]
    assert t.namespace("p0") == "pdtb-p0"
    assert t.switch_namespace == "pdtb-switch"
    assert Topology(("a",), subnet="192.168.7.0/24").address("a") == "192.168.7.10"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hosts": ()}, "at least one host"),
    ({"hosts": ("p0", "p0")}, "must be unique"),
    ({"hosts": ("switch",)}, "not 'switch'"),
    ({"hosts": ("P0",)}, "bad: 'P0'"),
    ({"hosts": ("averyverylonghost",)}, "up to 11"),
    ({"hosts": ("a",), "prefix": "pd"}, "final '-'"),
    ({"hosts": ("a",), "subnet": "8.8.8.0/24"}, "private IPv4"),
    ({"hosts": ("a",), "subnet": "10.0.0.0/29"}, "no room for 1 hosts"),
    ({"hosts": ("a",), "subnet": "nonsense"}, "not a network"),
])
def test_bad_topologies_say_what_to_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_an_unknown_host_names_the_hosts_there_are() -> None:
    with pytest.raises(ValueError, match="no host 'd9' in this testbed \\(hosts: router, p0\\)"):
        Topology(("router", "p0")).address("d9")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gbps": 0}, "link rate must be in"),
    ({"delay_ms": -1}, "delay must be in"),
    ({"delay_ms": 1, "jitter_ms": 2}, "jitter must be in \\[0, delay\\]"),
    ({"loss_pct": 101}, "loss must be a percentage"),
])
def test_bad_link_shapes_say_what_to_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LinkShape(**kwargs)


def test_only_delay_and_jitter_need_a_delay() -> None:
    assert not LinkShape(gbps=1, loss_pct=5).needs_delay
    assert LinkShape(delay_ms=0.5).needs_delay
    assert LinkShape(gbps=1).changed(delay_ms=2, gbps=None) == LinkShape(gbps=1, delay_ms=2)


def test_each_direction_gets_the_rate_and_half_the_delay() -> None:
    tree = shaping.tree("p-d0", LinkShape(gbps=1, delay_ms=5, jitter_ms=1), netem=True)
    assert tree[1][:13] == ["class", "add", "dev", "p-d0", "parent", "1:", "classid", "1:10",
                            "htb", "rate", "1000000000bit", "ceil", "1000000000bit"]
    leaf = tree[2]
    assert leaf[leaf.index("netem"):leaf.index("netem") + 4] == ["netem", "delay", "2500us",
                                                                 "500us"]
    assert shaping.leaf(LinkShape(gbps=10)) == ["bfifo", "limit", str(6_250_000)]
    # without netem the delay line holds the packets: the leaf is the plain queue
    assert shaping.leaf(LinkShape(gbps=10, delay_ms=5)) == ["bfifo", "limit", str(6_250_000)]
    assert shaping.leaf(LinkShape(gbps=0.01)) == ["bfifo", "limit", str(256 * 1024)]


def test_the_loss_program_matches_that_share_of_random_numbers() -> None:
    code = shaping.loss_bytecode(25.0).split(",")
    assert code[0] == "4"  # four instructions
    threshold = int(code[2].split()[3])
    assert threshold == 2**30  # random < 2^32 / 4: matched (dropped)
    assert shaping.loss_bytecode(100) == "1,6 0 0 4294967295"
    assert shaping.filters("i-p0", 0.0) == []
    partition = shaping.filters("i-p0", 0.0, ("10.250.0.12",))
    assert partition == [["filter", "add", "dev", "i-p0", "parent", "1:", "protocol", "ip",
                          "prio", "1", "u32", "match", "ip", "dst", "10.250.0.12/32",
                          "flowid", "1:20"]]


def test_the_state_reads_back_and_knows_partitions() -> None:
    t = Topology(("router", "p0", "d0", "d1"), "pdq-")
    shape = LinkShape(gbps=2, loss_pct=1)
    bed = BedState(t, {h: shape for h in t.hosts}, delay=DelayMethod.QUEUE,
                   partitions=frozenset({("d0", "p0"), ("d1", "p0")}))
    assert BedState.from_json(bed.to_json()) == bed
    assert bed.cut_from("p0") == ("d0", "d1")
    assert bed.cut_from("router") == ()
    with pytest.raises(ValueError, match="sorted"):
        BedState(t, bed.links, partitions=frozenset({("p0", "d0")}))


def test_a_machine_without_root_or_iproute2_gets_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(namespaces.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match=r"needs root .* run it with sudo"):
        namespaces.check_can_build()
    monkeypatch.setattr(namespaces.os, "geteuid", lambda: 0)
    monkeypatch.setattr(namespaces.shutil, "which", lambda tool: None)
    with pytest.raises(TestbedError, match="needs iproute2's ip and tc on PATH"):
        namespaces.check_can_build()
