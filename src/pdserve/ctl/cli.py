"""`pdserve ctl --url http://ROUTER --secret-file FILE COMMAND`: see and steer the pools.

- `workers [--json]`: every worker in the router's pool (name, url, role, state, queue, legs,
  KV blocks used and total), as a table or a JSON list.
- `flip NAME --role ROLE [--json]`: the router drains worker NAME and switches its role; prints
  the result (`{"worker", "from", "to", "seconds"}` with --json).
- `lend NAME --to OTHER [--json]`: prefill worker NAME drains and its cores go to decode-capable
  worker OTHER of the same machine (`{"worker", "to", "cpus", "seconds"}`); `reclaim NAME
  [--json]`: they come back and NAME serves as a prefill worker again (`{"worker", "from",
  "cpus", "pinned_back", "seconds"}`).

Exit status: 0 done; 1 the router could not be reached or refused (its message is printed);
2 bad arguments or secret file (before any request).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve.common.engine_options import Role
from pdserve.common.worker_name import check_base_url, check_worker_name
from pdserve.ctl.client import CtlError, RouterClient
from pdserve.ctl.table import workers_table
from pdserve.internal_auth import InternalAuth, read_secret_file

WORKERS_PATH = "/internal/workers"
LIST_TIMEOUT_S = 10.0
FLIP_TIMEOUT_S = 600.0  # above the router's --flip-timeout default (300 s)


def add_ctl_parser(subparsers: argparse._SubParsersAction) -> None:
    """`pdserve ctl`."""
    p = subparsers.add_parser(
        "ctl", help="see and steer a running cluster's worker pools",
        description="Lists the workers of a running router's pool, flips their roles and "
                    "lends cores between workers of one machine, with requests signed with "
                    "the cluster secret.")
    p.add_argument("--url", required=True,
                   help="the router's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--secret-file", type=Path, required=True, metavar="FILE",
                   help="file holding the cluster secret (the router's --secret-file)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help=f"seconds to wait for the router's answer (default: {LIST_TIMEOUT_S:g} "
                        f"for workers, {FLIP_TIMEOUT_S:g} for flip, lend and reclaim, which "
                        "wait for a worker to drain)")
    sub = p.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    w = sub.add_parser("workers", help="list the pool's workers",
                       description="Every worker in the router's pool: name, url, role, state "
                                   "(healthy, unhealthy, flipping, draining, lent), queue "
                                   "(requests in flight on it), legs, KV blocks used and "
                                   "total, the cores it computes on.")
    w.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    w.set_defaults(func=_workers, default_timeout=LIST_TIMEOUT_S)
    f = sub.add_parser("flip", help="switch a worker's role",
                       description="The router stops giving the worker new work, the worker "
                                   "drains its legs and switches, and the router routes to it "
                                   "in its new role.")
    f.add_argument("name", help="the worker's name (see `pdserve ctl ... workers`)")
    f.add_argument("--role", required=True, choices=[r.value for r in Role])
    f.add_argument("--json", action="store_true", help="print the result as JSON")
    f.set_defaults(func=_flip, default_timeout=FLIP_TIMEOUT_S)
    lend = sub.add_parser("lend", help="lend a prefill worker's cores to a decode worker",
                          description="The router stops giving prefill worker NAME new work; "
                                      "once its prompts are done, decode (or collocated) "
                                      "worker OTHER on the same machine computes on its own "
                                      "cores and NAME's, and prefills every prompt itself in "
                                      "chunks paced to the TPOT target. `reclaim NAME` gives "
                                      "them back.")
    lend.add_argument("name", help="the prefill worker whose cores are lent")
    lend.add_argument("--to", required=True, metavar="OTHER",
                      help="the decode or collocated worker that gets them")
    lend.add_argument("--json", action="store_true", help="print the result as JSON")
    lend.set_defaults(func=_lend, default_timeout=FLIP_TIMEOUT_S)
    back = sub.add_parser("reclaim", help="take a lent worker's cores back",
                          description="The worker that borrowed NAME's cores computes on its "
                                      "own again, and NAME serves as a prefill worker.")
    back.add_argument("name", help="the worker whose cores were lent")
    back.add_argument("--json", action="store_true", help="print the result as JSON")
    back.set_defaults(func=_reclaim, default_timeout=FLIP_TIMEOUT_S)


def _client(args: argparse.Namespace) -> RouterClient:
    """ValueError for a bad URL, timeout or secret file."""
    url = check_base_url(args.url, "--url")
    timeout = args.default_timeout if args.timeout is None else args.timeout
    if not timeout > 0:
        raise ValueError("--timeout must be > 0 seconds")
    return RouterClient(url, InternalAuth(read_secret_file(args.secret_file)), timeout)


def _workers(args: argparse.Namespace) -> int:
    client = _client(args)
    return _run(lambda: _show_workers(client.call("GET", WORKERS_PATH), args.json))


def _flip(args: argparse.Namespace) -> int:
    name = check_worker_name(args.name)
    client = _client(args)
    return _run(lambda: _show_flip(client.call("POST", f"{WORKERS_PATH}/{name}/flip",
                                               {"role": args.role}), args.json))


def _lend(args: argparse.Namespace) -> int:
    name, to = check_worker_name(args.name), check_worker_name(args.to)
    client = _client(args)
    return _run(lambda: _show_loan(client.call("POST", f"{WORKERS_PATH}/{name}/lend",
                                               {"to": to}), args.json))


def _reclaim(args: argparse.Namespace) -> int:
    name = check_worker_name(args.name)
    client = _client(args)
    return _run(lambda: _show_loan(client.call("POST", f"{WORKERS_PATH}/{name}/reclaim", {}),
                                   args.json))


def _run(action: Callable[[], None]) -> int:
    try:
        action()
    except CtlError as e:
        print(f"pdserve ctl: error: {e}", file=sys.stderr)
        return 1
    return 0


def _show_workers(workers: list, as_json: bool) -> None:
    print(json.dumps(workers, indent=2) if as_json else workers_table(workers))


def _show_flip(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        print(f"worker {result['worker']}: {result['from']} -> {result['to']} in "
              f"{result['seconds']:.1f} s")


def _show_loan(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    elif "to" in result:
        print(f"worker {result['worker']}: cores lent to {result['to']} (now on "
              f"{','.join(map(str, result['cpus']))}) in {result['seconds']:.1f} s")
    else:
        late = "" if result["pinned_back"] else \
            f" ({result['from']} is pinned back when it answers again)"
        print(f"worker {result['worker']}: cores {','.join(map(str, result['cpus']))} back "
              f"from {result['from']} in {result['seconds']:.1f} s{late}")
