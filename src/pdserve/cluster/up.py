"""`pdserve up`: a router and its workers as separate processes on this machine, one command.

`add_up_parser` registers the sub-command; `run_up` is its handler. Start-up has two phases:
every worker, then (once all answer /health) the router. Ctrl-C or SIGTERM stops everything;
a per-run cluster secret file is deleted on the way out (one given with --secret-file is kept).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from pdserve.api.limits import add_limit_args
from pdserve.cli_args import (
    add_cpu_kernels_arg,
    add_device_arg,
    add_enforce_eager_arg,
    add_log_level_arg,
    add_model_args,
)
from pdserve.cluster.layout import (
    HTTP_PORT_OFFSET,
    KV_PORT_OFFSET,
    MAX_WORKERS,
    POLICIES,
    TRANSPORTS,
    UpConfig,
    base_url,
    plan_processes,
    planned_ports,
    worker_cores,
)
from pdserve.cluster.ports import check_ports_free
from pdserve.cluster.secret import remove_secret, remove_stale_secrets, write_secret
from pdserve.cluster.supervisor import ClusterError, run
from pdserve.cluster.testbed_hosts import enter_router_host, load_placement, place
from pdserve.common.engine_options import resolve_dtype
from pdserve.internal_auth import InternalAuth, read_secret_file
from pdserve.router.access import add_client_access_args
from pdserve.router.admission_settings import add_admission_args
from pdserve.router.elastic_settings import add_elastic_args
from pdserve.testbed.topology import DEFAULT_PREFIX
from pdserve.workers.settings import KV_CONGESTION_HELP, LAYERWISE, LAYERWISE_HELP

__all__ = ["UpConfig", "add_up_parser", "plan_processes", "run_up"]

_DESCRIPTION = (
    "Start a complete disaggregated server on this machine: prefill workers, decode workers and "
    "a router with an OpenAI-compatible API, each its own process. By default one prefill and "
    "one decode worker; --collocated N runs N workers that do both instead. Workers start "
    "first; the router starts once every worker answers /health (a health check signed with "
    "the run's cluster secret, answered with the worker's proof that it holds it, so a process "
    "without it, such as one left on a port by an earlier run, never counts). Worker logs "
    "appear on stderr, each line prefixed with [name]. Ctrl-C (or SIGTERM) stops every process."
)
_EPILOG = (
    f"Ports: the router listens on PORT; worker i (prefill workers first, then decode) serves "
    f"HTTP on PORT+{HTTP_PORT_OFFSET}+i and KV transfers on PORT+{KV_PORT_OFFSET}+i, so with "
    f"the defaults prefill-0 is on 8001 (KV 8101) and decode-0 on 8002 (KV 8102); at most "
    f"{MAX_WORKERS} workers. Cores: each worker counts one share per tensor-parallel rank "
    "(--prefill-tp, --decode-tp, --collocated-tp); the C cores in --cpus are split among the "
    "shares in order when there are at least as many cores as shares (one collocated worker "
    "on 2 cores gets both), else share u gets the (u mod C)-th core; the router is not "
    "pinned. The cluster secret (it authenticates the router to the workers and the workers' KV "
    "transfers to each other) is made at random for each run, passed to the router and the "
    "workers in a private file (mode 0600) and deleted at stop, unless --secret-file gives one. "
    "Clients reach the model through the router only: a worker's own /v1 answers 403 unless "
    "--serve-public. Examples: pdserve up --prefill 2 --decode 1 --cpus 0-2; pdserve up "
    "--prefill-tp 2 --decode-tp 1 --cpus 0-2 (prefill on 2 processes, KV handed to a 1-process "
    "decode worker)")


def add_up_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `up` on `subparsers` with func = run_up."""
    p = subparsers.add_parser("up", help="run a router and prefill/decode workers on this "
                                         "machine", description=_DESCRIPTION, epilog=_EPILOG)
    _add_layout_args(p)
    _add_engine_args(p)
    _add_router_args(p)
    _add_access_args(p)
    p.set_defaults(func=run_up)


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill workers (default: 1)")
    p.add_argument("--decode", type=int, default=None, metavar="N",
                   help="decode workers (default: 1)")
    p.add_argument("--collocated", type=int, default=None, metavar="N",
                   help="run N workers that prefill and decode themselves, no KV transfer; "
                        "excludes --prefill and --decode")
    for role in ("prefill", "decode", "collocated"):
        p.add_argument(f"--{role}-tp", type=int, default=1, metavar="N",
                       help=f"tensor-parallel processes of each {role} worker, each on its "
                            f"share of the worker's cores, heads, MLP columns (default: 1)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every process binds to (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="router port; workers use the ports after it, see below "
                        "(default: %(default)s)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="cores to spread the workers over, e.g. 0,1,4-7, split evenly (see "
                        "below) (default: every core this process may use)")
    p.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="give up (and stop everything) if the workers and the router are not "
                        "all healthy within this time (default: %(default)s)")
    p.add_argument("--testbed", nargs="?", const=DEFAULT_PREFIX, default=None, metavar="PREFIX",
                   help="run across the hosts of a `pdserve testbed` (its prefix; default "
                        f"{DEFAULT_PREFIX}): the router on host 'router', prefill workers on "
                        "p0, p1..., decode workers on d0, d1... (--host is then theirs; see "
                        "docs/testbed.md)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_device_arg(p)
    add_log_level_arg(p)
    p.add_argument("--kv-cache-memory", default="512MiB", metavar="SIZE",
                   help="KV cache size of each worker, e.g. 512MiB or 2GiB "
                        "(default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + output in tokens (default: the model's context)")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="workers split long prompts into chunks that share steps with decodes "
                        "(the collocated baseline's usual setting)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="TOKENS",
                   help="tokens per engine step (default: 512 with chunked prefill, else the "
                        "context)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="most requests each worker runs in one step; more wait in its queue "
                        "(default: the worker's, 64)")
    add_cpu_kernels_arg(p)
    add_enforce_eager_arg(p)
    p.add_argument("--transport", default="tcp", choices=TRANSPORTS,
                   help="how KV blocks move from prefill to decode workers "
                        "(default: %(default)s)")
    p.add_argument("--kv-encrypt", action="store_true",
                   help="encrypt KV transfers with AES-256-GCM (tcp transport)")
    p.add_argument("--kv-congestion", default="", metavar="NAME", help=KV_CONGESTION_HELP)
    p.add_argument("--kv-layerwise", choices=LAYERWISE, default="auto", help=LAYERWISE_HELP)
    p.add_argument("--kv-lease", type=float, default=30.0, metavar="SECONDS",
                   help="longest wait of a decode worker's KV reservation for its prefill "
                        "worker, and of a held prefill for its decode worker, before either "
                        "gives up (the decode worker then recomputes) (default: %(default)s)")


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="least_loaded", choices=POLICIES,
                   help="how the router picks workers: round_robin in turn, least_loaded the "
                        "one with the fewest requests in flight, prefix the one most likely to "
                        "hold the prompt's prefix in its cache (default: %(default)s)")
    p.add_argument("--local-prefill-threshold", type=int, default=None, metavar="TOKENS",
                   help="a fixed rule: prompts whose uncached part is at most this many tokens "
                        "are prefilled by the decode worker itself, skipping the transfer "
                        "(default: decided per request from measured costs, see pdserve "
                        "router --help)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, metavar="MS",
                   help="time per output token a decode worker's streams should keep when it "
                        "prefills a prompt itself (default: %(default)s)")
    p.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="the longest gap between two tokens those streams should see: their "
                        "steps may run past --slo-tpot-ms, up to this, while the mean stays "
                        "within it, so that a prompt prefills in fewer, longer chunks (default: "
                        "the TPOT target: every step within it)")
    p.add_argument("--leg-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="longest silence of a worker on a request before the router gives up "
                        "on it (retried elsewhere if no token reached the client yet, else the "
                        "stream ends with an error) (default: %(default)s)")
    add_admission_args(p)
    add_elastic_args(p)


def _add_access_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", type=Path, default=None, metavar="FILE",
                   help="use the cluster secret in FILE (at least 16 bytes, readable only by "
                        "you) instead of a fresh one per run, e.g. to add workers started by "
                        "hand; checked before anything starts and never deleted")
    p.add_argument("--serve-public", action="store_true",
                   help="every worker also answers /v1 to any client that reaches its port "
                        "(benchmarks that address a worker directly); that bypasses the "
                        "router's API keys and limits")
    p.add_argument("--metrics-key-file", type=Path, default=None, metavar="FILE",
                   help="/metrics of the router and of every worker then requires "
                        "'Authorization: Bearer <key>' with a key from FILE, one a line "
                        "(default: /metrics is open)")
    add_client_access_args(p)  # the router's
    add_limit_args(p)


def run_up(args: argparse.Namespace) -> int:
    """Handler of `pdserve up`: 0 after Ctrl-C/SIGTERM, 1 when a process failed or died.

    Raises ValueError on bad options or a port in use (before anything starts). First removes
    the secret directories that runs killed before their cleanup left behind.
    """
    config = UpConfig.from_args(args)
    placement = None
    if args.testbed is not None:
        placement, config = load_placement(args.testbed, config)
    for folder in remove_stale_secrets():
        print(f"removed {folder}, left by a pdserve up that is gone", file=sys.stderr)
    secret = config.secret_file or write_secret()
    try:
        auth = InternalAuth(read_secret_file(secret))
        specs = plan_processes(config, secret)
        if placement is None:
            check_ports_free(config.host, planned_ports(config))
        else:
            specs = place(specs, config, placement)
            enter_router_host(placement)
        print(_layout_line(config), file=sys.stderr, flush=True)
        _note_kernel_build(config)
        return run([specs[:-1], specs[-1:]], config.ready_timeout_s,
                   on_ready=lambda: _announce(config), auth=auth)
    except ClusterError as e:
        print(f"pdserve: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if config.secret_file is None:
            remove_secret(secret)


def _workers_phrase(config: UpConfig) -> str:
    if config.num_collocated:
        return f"{config.num_collocated} collocated{_tp(config.collocated_tp)} workers"
    sealed = " (AES-256-GCM)" if config.kv_encrypt else ""
    return (f"{config.num_prefill} prefill{_tp(config.prefill_tp)}, {config.num_decode} "
            f"decode{_tp(config.decode_tp)} workers over {config.transport}{sealed}")


def _tp(size: int) -> str:
    return f" (TP {size})" if size > 1 else ""


def _layout_line(config: UpConfig) -> str:
    used = {c for i in range(config.num_workers) for c in worker_cores(config, i)}
    cores = ",".join(map(str, sorted(used)))
    elastic = " (elastic: it flips workers between prefill and decode)" if config.elastic \
        else ""
    return (f"starting {_workers_phrase(config)} (model {config.model}, cores {cores}), "
            f"then the router on port {config.port}{elastic}")


def _note_kernel_build(config: UpConfig) -> None:
    """Say so, before the workers start, when their first health check waits on a build of the
    CPU operators (bf16 on CPU with them on, none cached for this environment)."""
    bf16 = resolve_dtype(config.dtype, config.device, config.cpu_kernels) == "bfloat16"
    if not (config.cpu_kernels and config.device == "cpu" and bf16):
        return
    from pdserve.engine import kernels

    if kernels.is_cached():
        return
    cores = min(len(worker_cores(config, i)) for i in range(config.num_workers))
    print(f"compiling pdserve's CPU operators once for this environment "
          f"({kernels.build_estimate(cores)} per worker); workers report ready after that",
          file=sys.stderr, flush=True)


def _announce(config: UpConfig) -> None:
    url = base_url(config.host, config.port)
    body = json.dumps({"model": config.model, "max_tokens": 32, "messages": [
        {"role": "user", "content": "What is the capital of France?"}]})
    print(f"pdserve is ready: {url}/v1 (model {config.model}; {_workers_phrase(config)})")
    print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d {shlex.quote(body)}")
    print("Ctrl-C stops every process.", flush=True)
