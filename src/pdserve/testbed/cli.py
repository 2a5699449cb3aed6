"""`pdserve testbed`: up, down, show, run, link, partition, heal, measure."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from pdserve.testbed import lifecycle, state
from pdserve.testbed import namespaces as ns
from pdserve.testbed.namespaces import TestbedError
from pdserve.testbed.probe import ProbeLimits, measure
from pdserve.testbed.state import BedState, DelayMethod
from pdserve.testbed.topology import DEFAULT_PREFIX, DEFAULT_SUBNET, LinkShape, Topology

_DESCRIPTION = (
    "Hosts on this machine: one network namespace per host, every host linked to one bridge "
    "(in a namespace of its own) by a veth pair shaped with tc in both directions: rate, loss "
    "and partitions; delay and jitter by the kernel's netem, or where the kernel lacks it by "
    "a user-space delay line on iptables' NFQUEUE. "
    "Addresses come from a private range and exist only inside the hosts; nothing changes on "
    "the machine's own interfaces. Needs root and iproute2. See docs/testbed.md.")
_EPILOG = ("Example: pdserve testbed up --hosts router,p0,d0 --link-gbps 10; pdserve up "
           "--testbed --prefill 1 --decode 1; pdserve testbed run router -- curl "
           "http://10.250.0.10:8000/v1/models; pdserve testbed link d0 --gbps 0.1; pdserve "
           "testbed down")


def add_testbed_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `testbed` and its commands on `subparsers`."""
    p = subparsers.add_parser("testbed", help="hosts in network namespaces joined by shaped "
                                              "links, on this machine",
                              description=_DESCRIPTION, epilog=_EPILOG)
    sub = p.add_subparsers(dest="testbed_command", required=True)
    _add_up(sub)
    _command(sub, "down", "remove every namespace of the testbed (ending the processes "
                          "inside) and its state file; also after a crashed up", _down)
    _command(sub, "show", "the hosts, their addresses and links", _show).add_argument(
        "--json", action="store_true")
    _add_run(sub)
    _add_link(sub)
    _add_partition(sub)
    _add_measure(sub)


def _command(sub: argparse._SubParsersAction, name: str, text: str,
             handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=text, description=text)
    p.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help="the testbed's name prefix, to keep two testbeds apart "
                        "(default: %(default)s)")
    p.set_defaults(func=lambda args: _guarded(handler, args))
    return p


def _guarded(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return handler(args)
    except TestbedError as e:
        print(f"pdserve testbed: error: {e}", file=sys.stderr)
        return 1


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "up", "make the hosts and their links", _up)
    p.add_argument("--hosts", required=True,
                   help="comma-separated host names, e.g. router,p0,d0,d1 (pdserve up "
                        "--testbed puts the router on 'router', prefill workers on p*, "
                        "decode workers on d*)")
    _add_shape_args(p, required=True)
    p.add_argument("--subnet", default=DEFAULT_SUBNET,
                   help="private IPv4 range of the hosts' addresses (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the testbed as JSON")


def _add_shape_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The link options: with their defaults for `up`, else None (= keep the link's value)."""
    base = LinkShape() if required else None

    def default(name: str) -> float | None:
        return None if base is None else getattr(base, name)

    p.add_argument("--link-gbps" if required else "--gbps", dest="gbps", type=float,
                   default=default("gbps"),
                   help="rate of each direction of each link, Gb/s (default: %(default)s)")
    p.add_argument("--delay-ms", type=float, default=default("delay_ms"),
                   help="one-way delay between two hosts with such links (half per link and "
                        "direction; netem or iptables) (default: %(default)s)")
    p.add_argument("--jitter-ms", type=float, default=default("jitter_ms"),
                   help="delay variation, at most the delay, uniform (netem or iptables) "
                        "(default: %(default)s)")
    p.add_argument("--loss", dest="loss_pct", type=float, default=default("loss_pct"),
                   help="percent of packets dropped in each direction of the link "
                        "(default: %(default)s)")


def _up(args: argparse.Namespace) -> int:
    topology = Topology(tuple(h.strip() for h in args.hosts.split(",") if h.strip()),
                        args.prefix, args.subnet)
    shape = LinkShape(args.gbps, args.delay_ms, args.jitter_ms, args.loss_pct)
    _print(lifecycle.up(topology, shape), args.json)
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = lifecycle.down(args.prefix)
    print(f"removed {len(removed)} namespaces" + (f": {', '.join(removed)}" if removed else ""))
    return 0


def _show(args: argparse.Namespace) -> int:
    bed = state.load(args.prefix)
    missing = sorted({bed.topology.namespace(h) for h in bed.topology.hosts}
                     - set(ns.names(args.prefix)))
    if missing:
        raise TestbedError(f"namespaces {', '.join(missing)} are gone: pdserve testbed down, "
                           "then up again")
    _print(bed, args.json)
    return 0


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "run", "run a command inside a host (ip netns exec)", _run)
    p.add_argument("host")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def _run(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ValueError("give the command after the host, e.g. pdserve testbed run p0 -- "
                         "ip addr")
    namespace = args.prefix + args.host
    if namespace not in ns.names(args.prefix):
        raise TestbedError(f"no host {args.host!r} in testbed {args.prefix!r} (namespace "
                           f"{namespace} does not exist)")
    os.execvp("ip", ns.exec_argv(namespace, argv))
    return 1  # not reached: exec replaced this process


def _add_link(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "link", "change a host's link while it runs (options not given keep "
                              "their value)", _link)
    p.add_argument("host")
    _add_shape_args(p, required=False)
    p.add_argument("--json", action="store_true")


def _link(args: argparse.Namespace) -> int:
    bed = lifecycle.set_link(args.prefix, args.host, gbps=args.gbps, delay_ms=args.delay_ms,
                             jitter_ms=args.jitter_ms, loss_pct=args.loss_pct)
    _print(bed, args.json)
    return 0


def _add_partition(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "partition", "drop every packet between two hosts, both ways",
                 lambda a: _print_ok(lifecycle.partition(a.prefix, a.a, a.b)))
    p.add_argument("a")
    p.add_argument("b")
    p = _command(sub, "heal", "end the partition between two hosts (none given: all)",
                 lambda a: _print_ok(lifecycle.heal(a.prefix, a.a, a.b)))
    p.add_argument("a", nargs="?")
    p.add_argument("b", nargs="?")


def _add_measure(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "measure", "measure rate and round trip from one host to another over "
                                 "TCP (bounded in time and bytes)", _measure)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="how long to send (default: %(default)s)")
    p.add_argument("--json", action="store_true")


def _measure(args: argparse.Namespace) -> int:
    m = measure(state.load(args.prefix), args.src, args.dst, ProbeLimits(seconds=args.seconds))
    if args.json:
        print(json.dumps({"src": args.src, "dst": args.dst, **m.to_json()}))
    else:
        print(f"{args.src} -> {args.dst}: {m.gbps:.3f} Gb/s TCP goodput "
              f"({m.bytes} bytes in {m.seconds:.2f} s), round trip {m.rtt_ms:.3f} ms")
    return 0


def _print_ok(bed: BedState) -> int:
    _print(bed, as_json=False)
    return 0


_DELAY_BY = {
    DelayMethod.NETEM: "(delay and jitter: the kernel's netem)",
    DelayMethod.QUEUE: "(delay and jitter: the user-space delay line, no netem in this kernel)",
    DelayMethod.NONE: "(no netem and no iptables NFQUEUE: links have rate and loss, no delay or "
                      "jitter)"}


def _print(bed: BedState, as_json: bool) -> None:
    if as_json:
        print(json.dumps(bed.to_json(), indent=1))
        return
    t = bed.topology
    for host in t.hosts:
        s = bed.links[host]
        cut = bed.cut_from(host)
        print(f"{host:12} {t.address(host):15} namespace {t.namespace(host):20} "
              f"{s.gbps:g} Gb/s, delay {s.delay_ms:g} ms, jitter {s.jitter_ms:g} ms, "
              f"loss {s.loss_pct:g}%" + (f", cut from {','.join(cut)}" if cut else ""))
    print(_DELAY_BY[bed.delay])
