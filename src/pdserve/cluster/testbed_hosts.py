"""`pdserve up --testbed`: the same processes as `pdserve up`, each on a host of a testbed.

Placement: the router on host "router", prefill workers on the hosts named p<N>, decode and
collocated workers on d<N> (round robin within a role, so two workers may share a host). The
plan is `pdserve up`'s (`cluster/layout.py`), then moved: each worker binds every address of
its host (`--host 0.0.0.0`) and advertises the host's address (`--advertise`), which the
router's worker URLs and the health checks use; each process runs in its host's namespace
(`ip netns exec`). `up` itself enters the router's namespace before it starts anything (its
health checks then travel over the testbed like the router's requests), so from then on this
process reaches the hosts and nothing of the machine's own network. Workers on NIXL are told to
use the host's link only (UCX_NET_DEVICES, UCX_TLS: tcp, so UCX cannot take shared memory
between two hosts that are one machine) and to log the protocols UCX picked (UCX_PROTO_INFO).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

from pdserve.cluster.child import ProcessSpec
from pdserve.cluster.layout import HTTP_PORT_OFFSET, UpConfig, base_url, worker_url
from pdserve.testbed import state
from pdserve.testbed.namespaces import TestbedError, enter_for_good, exec_argv
from pdserve.testbed.state import BedState
from pdserve.testbed.topology import HOST_LINK

ROUTER_HOST = "router"
_ROLE_LETTER = {"prefill": "p", "decode": "d", "collocated": "d"}
BIND_ALL = "0.0.0.0"


@dataclass(frozen=True)
class Placement:
    """Which host of `bed` runs the router and each worker (index as in `UpConfig.roles`)."""

    bed: BedState
    router: str
    workers: tuple[str, ...]

    def __post_init__(self) -> None:
        for host in (self.router, *self.workers):
            self.bed.topology.address(host)  # ValueError for a host not in the testbed

    def address(self, host: str) -> str:
        return self.bed.topology.address(host)

    def namespace(self, host: str) -> str:
        return self.bed.topology.namespace(host)


def load_placement(prefix: str, config: UpConfig) -> tuple[Placement, UpConfig]:
    """`placement_for` the testbed with this prefix. ValueError when there is none."""
    try:
        bed = state.load(prefix)
    except TestbedError as e:
        raise ValueError(str(e)) from None
    return placement_for(bed, config)


def placement_for(bed: BedState, config: UpConfig) -> tuple[Placement, UpConfig]:
    """Where `config`'s processes run on `bed`, and the config with the router's address as
    its host. ValueError when the testbed lacks a host the plan needs."""
    hosts = bed.topology.hosts
    if ROUTER_HOST not in hosts:
        raise ValueError(f"testbed {bed.topology.prefix!r} has no host {ROUTER_HOST!r} for "
                         f"the router (hosts: {', '.join(hosts)})")
    workers = tuple(_pick(hosts, role, config.roles[:i].count(role))
                    for i, role in enumerate(config.roles))
    placement = Placement(bed, ROUTER_HOST, workers)
    return placement, replace(config, host=placement.address(ROUTER_HOST))


def _pick(hosts: tuple[str, ...], role: str, nth: int) -> str:
    """The host of the `nth` worker of `role`: its role's hosts in turn, by number."""
    letter = _ROLE_LETTER[role]
    matching = sorted((h for h in hosts if re.fullmatch(rf"{letter}\d+", h)),
                      key=lambda h: int(h[1:]))
    if not matching:
        raise ValueError(f"the testbed has no host for a {role} worker ({letter}0, {letter}1, "
                         f"...; hosts: {', '.join(hosts)})")
    return matching[nth % len(matching)]


def place(specs: list[ProcessSpec], config: UpConfig, placement: Placement) -> list[ProcessSpec]:
    """`plan_processes(config, ...)` (workers in order, then the router) moved onto the hosts.
    `config` is the one `load_placement` returned: worker URLs in the plan are its host with
    each worker's own port, so every one maps to exactly one worker."""
    *workers, router = specs
    urls = {worker_url(config, i): _url(config, placement, i) for i in range(len(workers))}
    moved = [_worker(spec, config, placement, i, urls) for i, spec in enumerate(workers)]
    argv = tuple(urls.get(a, a) for a in router.argv)
    ns = placement.namespace(placement.router)
    return [*moved, replace(router, argv=tuple(exec_argv(ns, argv)))]


def enter_router_host(placement: Placement) -> None:
    """Move this process into the router's host for good (call before any thread starts)."""
    enter_for_good(placement.namespace(placement.router))
    print(f"running on testbed {placement.bed.topology.prefix!r}: the router on host "
          f"{placement.router!r}, workers on {', '.join(placement.workers)}; clients reach "
          f"it from inside the testbed: pdserve testbed run {placement.router} -- curl ...",
          file=sys.stderr, flush=True)


def _url(config: UpConfig, placement: Placement, index: int) -> str:
    port = config.port + HTTP_PORT_OFFSET + index
    return base_url(placement.address(placement.workers[index]), port)


def _worker(spec: ProcessSpec, config: UpConfig, placement: Placement, index: int,
            urls: dict[str, str]) -> ProcessSpec:
    host = placement.workers[index]
    argv = list(spec.argv)
    at = argv.index("--host")
    argv[at:at + 2] = ["--host", BIND_ALL, "--advertise", placement.address(host)]
    env = _ucx_env(config) if config.transport == "nixl" else None
    health = spec.health_url.replace(worker_url(config, index), urls[worker_url(config, index)])
    return replace(spec, argv=tuple(exec_argv(placement.namespace(host), argv)),
                   health_url=health, env=env)


def _ucx_env(config: UpConfig) -> dict[str, str]:
    tls = "tcp,cuda_copy" if config.device.startswith("cuda") else "tcp"
    return {"UCX_NET_DEVICES": HOST_LINK, "UCX_TLS": tls, "UCX_PROTO_INFO": "y"}
