"""`pdserve up --testbed`'s plan: `pdserve up`'s processes, each run inside its host, workers
bound to every address of their host and advertising the host's address, the router pointed
at those addresses (no namespaces needed: the plan is pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster.layout import UpConfig, plan_processes
from pdserve.cluster.testbed_hosts import load_placement, place, placement_for
from pdserve.testbed.state import BedState
from pdserve.testbed.topology import LinkShape, Topology

SECRET = Path("/run/secret")


def _bed(*hosts: str) -> BedState:
    t = Topology(hosts, "pdq-")
    return BedState(t, {h: LinkShape() for h in hosts})


def _argv_after(argv: tuple[str, ...], flag: str, n: int = 1) -> list[str]:
    at = argv.index(flag)
    return list(argv[at + 1:at + 1 + n])


def test_each_process_runs_on_its_host_and_workers_advertise_it() -> None:
    bed = _bed("router", "p0", "d0", "d1")
    placement, config = placement_for(bed, UpConfig(model="m", num_prefill=2, num_decode=2,
                                                    transport="nixl"))
    assert placement.workers == ("p0", "p0", "d0", "d1")
    assert config.host == "10.250.0.10"
    *workers, router = place(plan_processes(config, SECRET), config, placement)
    for i, (spec, host) in enumerate(zip(workers, placement.workers, strict=True)):
        address = bed.topology.address(host)
        assert spec.argv[:4] == ("ip", "netns", "exec", f"pdq-{host}")
        assert _argv_after(spec.argv, "--host") == ["0.0.0.0"]
        assert _argv_after(spec.argv, "--advertise") == [address]
        assert spec.health_url == f"http://{address}:{8001 + i}/health"
        assert spec.env == {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp", "UCX_PROTO_INFO": "y"}
    assert router.argv[:4] == ("ip", "netns", "exec", "pdq-router")
    assert _argv_after(router.argv, "--host") == ["10.250.0.10"]
    assert _argv_after(router.argv, "--prefill", 2) == ["http://10.250.0.11:8001",
                                                        "http://10.250.0.11:8002"]
    assert _argv_after(router.argv, "--decode", 2) == ["http://10.250.0.12:8003",
                                                       "http://10.250.0.13:8004"]
    assert router.health_url == "http://10.250.0.10:8000/health"


def test_tcp_workers_get_no_ucx_settings() -> None:
    placement, config = placement_for(_bed("router", "p0", "d0"), UpConfig(model="m"))
    assert all(spec.env is None for spec in place(plan_processes(config, SECRET), config,
                                                  placement))


@pytest.mark.parametrize(("hosts", "match"), [
    (("p0", "d0"), "has no host 'router' for the router"),
    (("router", "p0"), "no host for a decode worker \\(d0, d1, ...; hosts: router, p0\\)"),
    (("router", "d0"), "no host for a prefill worker"),
])
def test_a_testbed_without_the_hosts_a_plan_needs_says_which(hosts: tuple[str, ...],
                                                             match: str) -> None:
    with pytest.raises(ValueError, match=match):
        placement_for(_bed(*hosts), UpConfig(model="m"))


def test_up_on_a_testbed_that_does_not_exist_says_to_make_it() -> None:
    with pytest.raises(ValueError, match=r"no testbed with prefix 'pdnone-' .* testbed up first"):
        load_placement("pdnone-", UpConfig(model="m"))
