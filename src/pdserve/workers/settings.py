"""`pdserve worker` settings: one frozen dataclass, validated, built from the command line.

The command line both ways: `WorkerLaunch` is its values, `worker_argv` writes them (what
`pdserve up` runs) and `launch_from_args` reads them back, equal. Files named on the command
line (`--secret-file`, `--metrics-key-file`) stay named in a launch and are read and checked by
`worker_settings`, so a worker refuses a missing, unreadable or too-short one before it loads a
model, and no argv ever holds a secret.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path

from pdserve.api.limits import (
    DEFAULT_LIMITS,
    RequestLimits,
    add_limit_args,
    limits_from_args,
    limits_to_args,
)
from pdserve.bearer import read_key_file
from pdserve.cli_args import (
    add_cpu_kernels_arg,
    add_device_arg,
    add_enforce_eager_arg,
    add_log_level_arg,
    add_tensor_parallel_arg,
    log_level,
    parse_cpus,
    parse_size,
)
from pdserve.common.engine_options import DTYPE_CHOICES, DTYPE_HELP, Role
from pdserve.config import EngineConfig
from pdserve.internal_auth import InternalAuth, read_secret_file
from pdserve.workers.register import JoinSettings


class TransportName(StrEnum):
    TCP = "tcp"
    NIXL = "nixl"


LAYERWISE = ("auto", "on", "off")
KV_CONGESTION_HELP = ("TCP congestion control for the KV connections a worker dials (tcp "
                      "transport), e.g. cubic: no 200 ms stalls of a busy connection as BBR's "
                      "PROBE_RTT makes, but slow on a lossy link (docs/testbed.md); default: "
                      "the host's")


def check_kv_congestion(name: str, transport: str) -> None:
    """ValueError unless `name` is empty (the host's) or a congestion control the tcp
    transport can ask for; `pdserve worker` and `pdserve up` check it alike."""
    if not name:
        return
    if transport != TransportName.TCP:
        raise ValueError("--kv-congestion sets the tcp transport's connections only (NIXL's "
                         "UCX makes its own): use --transport tcp, or leave it out")
    from pdserve.transfer.tcp.options import TcpOptions

    try:
        TcpOptions(congestion=name)
    except ValueError as e:
        raise ValueError(f"--kv-congestion: {e}") from None


LAYERWISE_HELP = ("prefill workers write each layer's KV while the next layers compute: on, "
                  "off, or auto = on for CUDA engines, off on CPU, where sending shares the "
                  "compute core and measured slower (pdserve bench layerwise) "
                  "(default: %(default)s)")
MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class WorkerSettings:
    role: Role
    engine: EngineConfig
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8001
    kv_host: str = "127.0.0.1"
    kv_port: int = 0  # 0: any free port
    kv_advertise: str | None = None  # the KV endpoint's host in its peer id (None: kv_host)
    transport: TransportName = TransportName.TCP
    # the cluster secret; None only for a collocated worker that serves /v1 itself
    secret: bytes | None = field(default=None, repr=False)
    serve_public: bool = False  # /v1 answers any client (else 403: clients use the router)
    # empty: /metrics is open; else it needs one of these as a bearer key
    metrics_keys: tuple[str, ...] = field(default=(), repr=False)
    cpus: tuple[int, ...] | None = None
    kv_lease_s: float = 30.0
    kv_encrypt: bool = False
    kv_congestion: str = ""  # the tcp transport's congestion control ("": the host's)
    kv_layerwise: str = "auto"  # "on" | "off" | "auto" (on for CUDA engines)
    limits: RequestLimits = field(default_factory=RequestLimits)  # what its /v1 accepts
    join: JoinSettings | None = None  # --register: join that router once loaded
    # --slo-tpot-ms: prompts beside decoding streams go in chunks that keep the streams' mean
    # time per token within it; --slo-itl-ms: and each gap within this (None: TPOT);
    # --slo-ttft-ms: steps run to the ITL ceiling while a prompt here would miss it otherwise
    tpot_target_s: float | None = None
    itl_target_s: float | None = None
    ttft_target_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "transport", TransportName(self.transport))
        if self.join is not None and self.secret is None:
            raise ValueError("--register needs the cluster secret (--secret-file): the router "
                             "accepts only workers that prove they hold it")
        if self.secret is None and not (self.role == Role.COLLOCATED and self.serve_public):
            raise ValueError(f"a {self.role} worker needs the cluster secret that authenticates "
                             "the router and KV transfers: give --secret-file (the same file "
                             "for every worker and the router); only a collocated worker that "
                             "serves clients itself (--serve-public) may run without one")
        if self.secret is not None:
            InternalAuth(self.secret)  # ValueError for a too-short secret
        if not 0 < self.port < 65536 or not 0 <= self.kv_port < 65536:
            raise ValueError("ports must be in 1-65535 (kv port 0: any free port)")
        if self.kv_advertise is not None:
            check_advertise(self.kv_advertise)
        if self.cpus is not None:
            allowed = os.sched_getaffinity(0)
            if not self.cpus or not set(self.cpus) <= allowed:
                raise ValueError(f"--cpus {list(self.cpus)} must be a non-empty subset of the "
                                 f"cores this process may use: {sorted(allowed)}")
        if not self.kv_lease_s > 0:
            raise ValueError("--kv-lease must be > 0 seconds")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise ValueError(f"--slo-tpot-ms must be > 0, got {self.tpot_target_s * 1e3:g}")
        check_pacing_targets(self.tpot_target_s, self.itl_target_s, self.ttft_target_s)
        if self.kv_layerwise not in LAYERWISE:
            raise ValueError(f"--kv-layerwise must be one of {', '.join(LAYERWISE)}, got "
                             f"{self.kv_layerwise!r}")
        if self.kv_encrypt and self.transport is not TransportName.TCP:
            raise ValueError("--kv-encrypt seals the tcp transport only (NIXL moves KV with "
                             "UCX, unencrypted): use --transport tcp, or a private network")
        self._check_congestion()
        if self.needs_transport and self.transport is TransportName.TCP \
                and self.engine.device.startswith("cuda"):
            raise ValueError(f"a {self.role} worker on {self.engine.device} keeps its KV in GPU "
                             "memory, and the tcp transport moves host memory only: use "
                             "--transport nixl (or --role collocated)")

    def _check_congestion(self) -> None:
        check_kv_congestion(self.kv_congestion, self.transport)

    @property
    def stream_layers(self) -> bool:
        """Layer-wise KV streaming: auto streams where compute has its own device (CUDA); on
        CPU the sending shares the compute core (measured: prefill slower by more than the
        transfer it hides, `pdserve bench layerwise`)."""
        if self.kv_layerwise == "auto":
            return str(self.engine.device).startswith("cuda")
        return self.kv_layerwise == "on"

    @property
    def needs_transport(self) -> bool:
        return self.role != Role.COLLOCATED


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=[r.value for r in Role], default="collocated",
                   help="prefill: computes prompts and ships their KV; decode: takes KV and "
                        "generates (and runs short prompts itself); collocated: both "
                        "(default: %(default)s)")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' or a Hugging Face model folder (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients use in 'model' (default: --model as given)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES), help=DTYPE_HELP)
    add_device_arg(p)
    add_log_level_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8001, help="HTTP port (default: %(default)s)")
    p.add_argument("--kv-host", default=None,
                   help="address of the KV transfer endpoint (default: --host)")
    p.add_argument("--kv-port", type=int, default=0,
                   help="KV transfer port (default: any free port; the router learns it from "
                        "/health)")
    p.add_argument("--advertise", default=None, metavar="ADDR",
                   help="the address the router and the other workers reach this worker at, "
                        "for HTTP (--register) and KV transfers (the host in its /health "
                        "'peer'), when it binds another one, e.g. --host 0.0.0.0 on a machine "
                        "others reach at ADDR (default: --host; for KV, --kv-host when given)")
    p.add_argument("--transport", choices=[t.value for t in TransportName], default="tcp",
                   help="KV transfer plane: tcp (no dependencies) or nixl (UCX; needs "
                        "nixl-cu12) (default: %(default)s)")
    p.add_argument("--secret-file", type=Path, default=None,
                   help="file holding the cluster secret (at least 16 bytes; the same file for "
                        "every worker and the router): it authenticates the router's requests "
                        "to /internal/* and signed /health, and KV transfer handshakes. "
                        "Required, except for a collocated worker with --serve-public")
    p.add_argument("--serve-public", action="store_true",
                   help="answer /v1/* for any client that reaches this port (a worker alone, or "
                        "a benchmark addressing a worker directly; it bypasses a router's API "
                        "keys and limits). Without it /v1/* answer 403: clients go through the "
                        "router")
    p.add_argument("--metrics-key-file", type=Path, default=None,
                   help="file with the key(s), one a line, that /metrics then requires as "
                        "'Authorization: Bearer <key>' (default: /metrics is open)")
    p.add_argument("--kv-encrypt", action="store_true",
                   help="encrypt KV transfers with AES-256-GCM under a key from the shared "
                        "secret (tcp transport; every worker needs the same setting)")
    p.add_argument("--kv-congestion", default="", metavar="NAME", help=KV_CONGESTION_HELP)
    p.add_argument("--kv-layerwise", choices=LAYERWISE, default="auto", help=LAYERWISE_HELP)
    p.add_argument("--cpus", default=None,
                   help="pin this worker to these cores, e.g. '0', '0,1' or '0-3' (compute "
                        "threads = number of cores; default: no pinning, all cores)")
    p.add_argument("--kv-cache-memory", default="512MiB",
                   help="KV pool size, e.g. 512MiB or 2GiB (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (overrides --kv-cache-memory)")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size,
                   help="tokens per KV block, a power of two; workers that move KV between "
                        "them need the same (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context)")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                   help="most requests in one batch (default: %(default)s)")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="split long prompts into chunks of --max-num-batched-tokens that share "
                        "steps with decodes")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (default: 512 with chunked prefill, else the "
                        "context)")
    p.add_argument("--kv-lease", type=float, default=30.0,
                   help="seconds a KV reservation or a held prefill may wait for the other "
                        "side before it is freed (default: %(default)s)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="time per output token to keep for the streams decoding here: a prompt "
                        "computed beside them (a local prefill on a decode worker) goes in "
                        "chunks sized from this worker's measured rates so that a step stays "
                        "within it (default: whole prompts)")
    p.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="with --slo-tpot-ms, the longest gap between two tokens of a stream: "
                        "a step beside the streams may run past the TPOT target, up to this, "
                        "spending what cheaper steps left of it, so that a prompt prefills in "
                        "fewer, longer chunks while the streams' mean stays within the target "
                        "(default: the TPOT target: every step within it)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="with --slo-tpot-ms, the time to first token to keep for the prompts "
                        "prefilled here: while one of them would miss it at the pace that "
                        "keeps the streams' mean within the TPOT target, the steps run to the "
                        "ITL ceiling (--slo-itl-ms) instead, trading the streams' mean time per "
                        "token for the prompts' first tokens (default: none)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (default: %(default)s)")
    add_cpu_kernels_arg(p)
    add_enforce_eager_arg(p)
    add_tensor_parallel_arg(p)
    add_limit_args(p)
    add_join_args(p)


def add_join_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("joining a running router")
    g.add_argument("--register", default=None, metavar="URL",
                   help="once loaded, join the router at URL (e.g. http://127.0.0.1:8000; "
                        "same --secret-file), send it heartbeats, and on SIGTERM drain and "
                        "leave its pool (default: wait to be named on a router's command line)")
    g.add_argument("--name", default=None,
                   help="this worker's name in the router's pool (default: HOST:PORT)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="with --register: on SIGTERM, the longest to wait for this worker's "
                        "legs to end before it leaves the pool (default: %(default)s)")


def add_worker_parser(subparsers: argparse._SubParsersAction) -> None:
    """`pdserve worker`."""
    p = subparsers.add_parser(
        "worker", help="one engine behind an OpenAI-compatible HTTP server",
        description="A prefill, decode or collocated worker behind a router: /internal/legs "
                    "(the WebSocket the router sends its legs on, signed with the cluster "
                    "secret), /health (liveness; details to signed requests) and /metrics. "
                    "With --serve-public it is also a complete OpenAI-compatible server on "
                    "its own (/v1/completions, /v1/chat/completions, /v1/models). Prefill "
                    "and decode workers move KV over the transfer plane.")
    add_worker_args(p)
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from pdserve.logs import setup
    from pdserve.workers.server import serve

    settings = settings_from_args(args)
    setup(f"{settings.role.value}:{settings.port}", log_level(args.log_level))
    return asyncio.run(serve(settings))


@dataclass(frozen=True)
class WorkerLaunch:
    """The values of one `pdserve worker` command line (defaults: the options' defaults). Files
    are named, not read: `worker_settings` reads them."""

    role: Role = Role.COLLOCATED
    model: str = "smollm2"
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8001
    kv_host: str | None = None  # None: host
    kv_port: int = 0
    advertise: str | None = None  # None: host (and kv_host for KV)
    transport: TransportName = TransportName.TCP
    secret_file: Path | None = None
    serve_public: bool = False
    metrics_key_file: Path | None = None
    kv_encrypt: bool = False
    kv_congestion: str = ""
    kv_layerwise: str = "auto"
    cpus: tuple[int, ...] | None = None  # None: not pinned
    kv_cache_memory: str = "512MiB"
    num_kv_blocks: int | None = None
    block_size: int = EngineConfig.block_size
    max_model_len: int | None = None
    max_num_seqs: int = MAX_NUM_SEQS
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: int | None = None
    kv_lease_s: float = 30.0
    slo_tpot_ms: float | None = None
    slo_itl_ms: float | None = None
    slo_ttft_ms: float | None = None
    seed: int = 0
    cpu_kernels: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    limits: RequestLimits = DEFAULT_LIMITS
    register: str | None = None  # the router to join
    name: str | None = None  # None: host:port
    drain_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "transport", TransportName(self.transport))
        if self.advertise is not None:
            check_advertise(self.advertise)
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"--cpus must name cores numbered from 0, got {self.cpus}")


# written whatever their value (a worker's log and `ps` show where it serves and how); every
# other option only when it differs from its default
_ALWAYS = (("--role", "role"), ("--model", "model"), ("--dtype", "dtype"),
           ("--device", "device"), ("--host", "host"), ("--port", "port"),
           ("--kv-port", "kv_port"), ("--transport", "transport"),
           ("--kv-cache-memory", "kv_cache_memory"), ("--kv-layerwise", "kv_layerwise"),
           ("--kv-lease", "kv_lease_s"))
_UNLESS_DEFAULT = (("--served-model-name", "served_model_name"), ("--kv-host", "kv_host"),
                   ("--advertise", "advertise"),
                   ("--secret-file", "secret_file"), ("--metrics-key-file", "metrics_key_file"),
                   ("--num-kv-blocks", "num_kv_blocks"), ("--block-size", "block_size"),
                   ("--max-model-len", "max_model_len"), ("--max-num-seqs", "max_num_seqs"),
                   ("--max-num-batched-tokens", "max_num_batched_tokens"), ("--seed", "seed"),
                   ("--slo-tpot-ms", "slo_tpot_ms"), ("--slo-itl-ms", "slo_itl_ms"),
                   ("--slo-ttft-ms", "slo_ttft_ms"),
                   ("--kv-congestion", "kv_congestion"),
                   ("--tensor-parallel-size", "tensor_parallel_size"),
                   ("--register", "register"), ("--name", "name"),
                   ("--drain-timeout", "drain_timeout_s"), ("--log-level", "log_level"))
_SWITCHES = (("--serve-public", "serve_public"), ("--kv-encrypt", "kv_encrypt"),
             ("--enable-chunked-prefill", "enable_chunked_prefill"),
             ("--enforce-eager", "enforce_eager"))
_DEFAULTS = {f.name: f.default for f in fields(WorkerLaunch)}


def worker_argv(launch: WorkerLaunch) -> list[str]:
    """The `pdserve worker` options that `launch_from_args` reads back as `launch`."""
    argv = [a for flag, name in _ALWAYS for a in (flag, str(getattr(launch, name)))]
    for flag, name in _UNLESS_DEFAULT:
        if getattr(launch, name) != _DEFAULTS[name]:
            argv += [flag, str(getattr(launch, name))]
    argv += [flag for flag, name in _SWITCHES if getattr(launch, name)]
    if launch.cpus is not None:
        argv += ["--cpus", ",".join(map(str, launch.cpus))]
    if not launch.cpu_kernels:
        argv.append("--no-cpu-kernels")
    return argv + limits_to_args(launch.limits)


def launch_from_args(args: argparse.Namespace) -> WorkerLaunch:
    """ValueError for bad --cpus or limits; files are not read here."""
    return WorkerLaunch(
        role=Role(args.role), model=args.model, served_model_name=args.served_model_name,
        dtype=args.dtype, device=args.device, host=args.host, port=args.port,
        kv_host=args.kv_host, kv_port=args.kv_port, advertise=args.advertise,
        transport=args.transport, secret_file=args.secret_file, serve_public=args.serve_public,
        metrics_key_file=args.metrics_key_file, kv_encrypt=args.kv_encrypt,
        kv_congestion=args.kv_congestion, kv_layerwise=args.kv_layerwise,
        cpus=parse_cpus(args.cpus) if args.cpus else None,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, enable_chunked_prefill=args.enable_chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_lease_s=args.kv_lease,
        slo_tpot_ms=args.slo_tpot_ms, slo_itl_ms=args.slo_itl_ms,
        slo_ttft_ms=args.slo_ttft_ms, seed=args.seed,
        cpu_kernels=args.cpu_kernels,
        enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
        limits=limits_from_args(args),
        register=args.register, name=args.name, drain_timeout_s=args.drain_timeout,
        log_level=args.log_level)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    return worker_settings(launch_from_args(args))


def worker_settings(launch: WorkerLaunch) -> WorkerSettings:
    """Reads and checks the files the launch names; ValueError for any bad value."""
    w = launch
    secret = None if w.secret_file is None else read_secret_file(w.secret_file)
    metrics_keys = () if w.metrics_key_file is None else \
        read_key_file(w.metrics_key_file, "--metrics-key-file")
    engine = EngineConfig(
        model=w.model, dtype=w.dtype, device=w.device, role=w.role, block_size=w.block_size,
        num_kv_blocks=w.num_kv_blocks, kv_cache_bytes=parse_size(w.kv_cache_memory),
        max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len, enable_chunked_prefill=w.enable_chunked_prefill,
        seed=w.seed, cpu_kernels=w.cpu_kernels, enforce_eager=w.enforce_eager,
        tensor_parallel_size=w.tensor_parallel_size)
    return WorkerSettings(
        role=w.role, engine=engine, served_model_name=w.served_model_name or w.model,
        host=w.host, port=w.port, kv_host=w.kv_host or w.host, kv_port=w.kv_port,
        kv_advertise=kv_advertise(w), transport=w.transport, secret=secret,
        serve_public=w.serve_public,
        metrics_keys=metrics_keys, cpus=w.cpus, kv_lease_s=w.kv_lease_s,
        kv_encrypt=w.kv_encrypt, kv_congestion=w.kv_congestion, kv_layerwise=w.kv_layerwise,
        limits=w.limits,
        join=join_settings(w),
        tpot_target_s=None if w.slo_tpot_ms is None else w.slo_tpot_ms / 1000.0,
        itl_target_s=None if w.slo_itl_ms is None else w.slo_itl_ms / 1000.0,
        ttft_target_s=None if w.slo_ttft_ms is None else w.slo_ttft_ms / 1000.0)


def check_pacing_targets(tpot_target_s: float | None, itl_target_s: float | None,
                         ttft_target_s: float | None = None) -> None:
    """ValueError unless an ITL ceiling, if any, comes with a TPOT target and is at least it,
    and a TTFT target, if any, is positive and comes with a TPOT target."""
    for value, flag in ((itl_target_s, "--slo-itl-ms"), (ttft_target_s, "--slo-ttft-ms")):
        if value is not None and tpot_target_s is None:
            raise ValueError(f"{flag} paces the steps of prompts beside streams: give "
                             "--slo-tpot-ms too (without it prompts are prefilled whole)")
    if ttft_target_s is not None and not ttft_target_s > 0:
        raise ValueError(f"--slo-ttft-ms must be > 0, got {ttft_target_s * 1e3:g}")
    if itl_target_s is not None and not itl_target_s >= tpot_target_s:
        raise ValueError(f"--slo-itl-ms ({itl_target_s * 1e3:g}) must be at least --slo-tpot-ms "
                         f"({tpot_target_s * 1e3:g}): a gap at most the ITL bound, their mean "
                         "at most the TPOT bound")


def join_settings(w: WorkerLaunch) -> JoinSettings | None:
    """Where and as what the worker joins a router (`--register`), or None."""
    if w.register is None:
        if w.name is not None:
            raise ValueError("--name names this worker in the pool it joins: give --register")
        return None
    reached = w.advertise or w.host
    if reached in WILDCARDS:
        raise ValueError(f"--register: the router reaches this worker at its --host, and "
                         f"{w.host!r} is every address: give the one the router can reach "
                         "(--advertise ADDR)")
    host = f"[{reached}]" if ":" in reached else reached
    return JoinSettings(router=w.register, name=w.name or f"{host}:{w.port}",
                        url=f"http://{host}:{w.port}", drain_timeout_s=w.drain_timeout_s)


WILDCARDS = ("0.0.0.0", "::", "")


def check_advertise(address: str) -> None:
    """ValueError unless `address` is one a peer can dial (not a wildcard, no spaces)."""
    if address in WILDCARDS or any(c.isspace() for c in address):
        raise ValueError(f"--advertise must be the one address others reach this worker at, "
                         f"not {address!r}")


def kv_advertise(w: WorkerLaunch) -> str | None:
    """The KV endpoint's host in its peer id: --kv-host when given as one address (a KV
    network of its own), else --advertise, else None (the bound address)."""
    if w.kv_host is not None and w.kv_host not in WILDCARDS:
        return None
    return w.advertise
