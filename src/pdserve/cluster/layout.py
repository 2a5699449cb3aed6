"""What `pdserve up` runs where: the validated options (`UpConfig`) and the process plan.

Port layout, fixed so a user can find every process: the router listens on PORT; worker i
(prefill workers first, then decode, or the collocated ones) serves HTTP on PORT+1+i and KV
transfers on PORT+101+i, so at most MAX_WORKERS workers. Cores (`worker_cores`): a worker
counts as many shares as its tensor-parallel ranks; with at least as many cores as shares,
the cores are split in order in proportion (1 prefill + 1 decode on 2 cores: one each; 1
collocated worker on 2 cores: both; a prefill worker at TP 2 and a decode worker at TP 1 on 6
cores: 4 and 2); with fewer, share u is core cpus[u mod len(cpus)]. The router is not
pinned. `plan_processes` is pure: same config and
secret path, same plan.

Every process gets the cluster secret file (`--secret-file`), and every ready check (of the
workers and the router) is signed and must come with the process's proof of the secret
(`ProcessSpec.signed_health`). Files the user names (`--secret-file`, `--metrics-key-file`)
are read and checked when the config is made, before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.api.limits import DEFAULT_LIMITS, RequestLimits, limits_from_args, limits_to_args
from pdserve.bearer import read_key_file
from pdserve.cli_args import parse_cpus, parse_size
from pdserve.cluster.child import ProcessSpec
from pdserve.common.engine_options import DTYPE_CHOICES, Role, check_device, resolve_dtype
from pdserve.internal_auth import read_secret_file
from pdserve.router.access import rate_limit_from_args
from pdserve.router.admission_settings import (
    AdmissionSettings,
    admission_from_args,
    admission_to_args,
)
from pdserve.router.elastic_settings import (
    DEFAULT_COOLDOWN_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_SLO_TTFT_MS,
    DEFAULT_SUSTAIN_TICKS,
    ElasticSettings,
    elastic_to_args,
)
from pdserve.router.rate_limit import RateLimit
from pdserve.workers.settings import (
    LAYERWISE,
    MAX_NUM_SEQS,
    TransportName,
    WorkerLaunch,
    check_kv_congestion,
    check_pacing_targets,
    worker_argv,
)

POLICIES = ("round_robin", "least_loaded", "prefix")
TRANSPORTS = tuple(t.value for t in TransportName)  # the worker's own choices
HTTP_PORT_OFFSET = 1
KV_PORT_OFFSET = 101
MAX_WORKERS = KV_PORT_OFFSET - HTTP_PORT_OFFSET


@dataclass(frozen=True)
class UpConfig:
    """The options of one `pdserve up`. Either num_collocated >= 1 and no prefill/decode
    workers, or num_collocated == 0 and at least one of each. `cpus` is non-empty, unique."""

    model: str = "smollm2"
    num_prefill: int = 1
    num_decode: int = 1
    num_collocated: int = 0
    prefill_tp: int = 1  # tensor-parallel ranks of each prefill worker
    decode_tp: int = 1
    collocated_tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    transport: str = "tcp"
    kv_encrypt: bool = False
    kv_congestion: str = ""  # the tcp transport's congestion control ("": the host's)
    kv_layerwise: str = "auto"
    kv_lease_s: float = 30.0
    dtype: str = "auto"
    device: str = "cpu"  # every worker's; they share it
    kv_cache_memory: str = "512MiB"
    max_model_len: int | None = None
    policy: str = "least_loaded"
    log_level: str = "info"  # every process's --log-level
    local_prefill_threshold: int | None = None  # None: the router decides from measured costs
    slo_tpot_s: float = 0.1
    slo_itl_s: float | None = None  # the paced steps' ceiling; None: the TPOT target
    elastic: bool = False  # the router flips workers between prefill and decode itself
    slo_ttft_s: float = DEFAULT_SLO_TTFT_MS / 1000.0  # the elastic controller's TTFT target
    elastic_interval_s: float = DEFAULT_INTERVAL_S  # the elastic controller's timing
    elastic_sustain_ticks: int = DEFAULT_SUSTAIN_TICKS
    elastic_cooldown_s: float = DEFAULT_COOLDOWN_S
    leg_timeout_s: float = 60.0
    ready_timeout_s: float = 300.0
    cpus: tuple[int, ...] = (0,)
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    cpu_kernels: bool = True
    enforce_eager: bool = False
    secret_file: Path | None = None  # the user's; None: `up` makes one for the run
    serve_public: bool = False  # every worker answers /v1 itself too (--serve-public)
    metrics_key_file: Path | None = None  # /metrics of every process needs its key
    api_keys_file: Path | None = None  # the router's /v1 needs one of its keys
    rate_limit: RateLimit | None = None  # the router's token bucket per key (or address)
    limits: RequestLimits = DEFAULT_LIMITS  # of every OpenAI endpoint, router and workers
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)  # back-pressure

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_choices()
        if self.secret_file is not None:
            read_secret_file(self.secret_file)  # ValueError naming the file
        for flag, path in (("--metrics-key-file", self.metrics_key_file),
                           ("--api-keys-file", self.api_keys_file)):
            if path is not None:
                read_key_file(path, flag)
        last_port = self.port + KV_PORT_OFFSET + self.num_workers - 1
        if self.port < 1 or last_port > 65535:
            raise ValueError(f"port {self.port} does not fit: {self.num_workers} workers use "
                             f"ports up to {last_port} (at most 65535)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.local_prefill_threshold is not None and self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0, got "
                             f"{self.local_prefill_threshold}")
        if not self.slo_tpot_s > 0:
            raise ValueError(f"--slo-tpot-ms must be > 0, got {self.slo_tpot_s * 1000:g}")
        check_pacing_targets(self.slo_tpot_s, self.slo_itl_s)
        if not self.slo_ttft_s > 0:
            raise ValueError(f"--slo-ttft-ms must be > 0, got {self.slo_ttft_s * 1000:g}")
        self._elastic_settings()  # ValueError naming a bad --elastic-* flag
        if self.elastic and self.num_collocated:
            raise ValueError("--elastic flips workers between prefill and decode: use it with "
                             "--prefill and --decode, not --collocated")
        if not self.leg_timeout_s > 0:
            raise ValueError(f"--leg-timeout must be > 0 seconds, got {self.leg_timeout_s}")
        if not self.kv_lease_s > 0:
            raise ValueError(f"--kv-lease must be > 0 seconds, got {self.kv_lease_s}")
        if self.leg_timeout_s <= self.kv_lease_s:
            raise ValueError(f"--leg-timeout ({self.leg_timeout_s} s) must exceed --kv-lease "
                             f"({self.kv_lease_s} s): a decode worker is silent for up to a "
                             "lease before it recomputes a prompt whose KV never came")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready timeout must be positive, got {self.ready_timeout_s}")
        if not self.cpus or min(self.cpus) < 0 or len(set(self.cpus)) != len(self.cpus):
            raise ValueError(f"cpus must be distinct core numbers >= 0, got {self.cpus}")
        if not self.model or not self.host:
            raise ValueError("model and host must be non-empty")

    def _check_counts(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_collocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.num_collocated and (self.num_prefill or self.num_decode):
            raise ValueError("--collocated excludes --prefill and --decode")
        if not self.num_collocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a disaggregated cluster needs --prefill >= 1 and --decode >= 1, "
                             f"got {self.num_prefill} and {self.num_decode}")
        if self.num_workers > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} workers, got {self.num_workers}")
        for flag, tp in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp),
                         ("--collocated-tp", self.collocated_tp)):
            if type(tp) is not int or tp < 1:
                raise ValueError(f"{flag} must be an int >= 1, got {tp!r}")
        if self.num_collocated and max(self.prefill_tp, self.decode_tp) > 1:
            raise ValueError("--prefill-tp and --decode-tp size prefill and decode workers; "
                             "use --collocated-tp with --collocated")
        if not self.num_collocated and self.collocated_tp > 1:
            raise ValueError("--collocated-tp sizes collocated workers; use --prefill-tp and "
                             "--decode-tp with --prefill and --decode")

    def _check_choices(self) -> None:
        for name, value, choices in (("transport", self.transport, TRANSPORTS),
                                     ("policy", self.policy, POLICIES),
                                     ("kv_layerwise", self.kv_layerwise, LAYERWISE),
                                     ("dtype", self.dtype, DTYPE_CHOICES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        parse_size(self.kv_cache_memory)  # the worker parses it the same way
        check_device(self.device)
        if self.device != "cpu" and self.transport == "tcp" and not self.num_collocated:
            raise ValueError(f"workers on {self.device} keep their KV in GPU memory, and the "
                             "tcp transport moves host memory only: use --transport nixl, or "
                             "--collocated N")
        if self.device != "cpu" and not self.num_collocated \
                and max(self.prefill_tp, self.decode_tp) > 1:
            raise ValueError(f"tensor-parallel prefill and decode workers share one KV pool "
                             f"among their ranks on the CPU only; on {self.device} use "
                             f"--collocated N --collocated-tp M, or TP 1")
        if self.kv_encrypt and self.transport != "tcp":
            raise ValueError("--kv-encrypt seals the tcp transport only (NIXL moves KV with "
                             "UCX, unencrypted)")
        check_kv_congestion(self.kv_congestion, self.transport)

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_collocated

    @property
    def roles(self) -> list[str]:
        """The role of worker i, for every i: prefill workers first, then decode."""
        return (["prefill"] * self.num_prefill + ["decode"] * self.num_decode
                + ["collocated"] * self.num_collocated)

    @property
    def tensor_parallel_sizes(self) -> list[int]:
        """The tensor-parallel size of worker i, for every i (in `roles` order)."""
        size = {"prefill": self.prefill_tp, "decode": self.decode_tp,
                "collocated": self.collocated_tp}
        return [size[role] for role in self.roles]

    @property
    def elastic_settings(self) -> ElasticSettings | None:
        """The router's elastic controller; None without --elastic."""
        return self._elastic_settings() if self.elastic else None

    def _elastic_settings(self) -> ElasticSettings:
        return ElasticSettings(ttft_target_s=self.slo_ttft_s, tpot_target_s=self.slo_tpot_s,
                               interval_s=self.elastic_interval_s,
                               sustain_ticks=self.elastic_sustain_ticks,
                               cooldown_s=self.elastic_cooldown_s)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpConfig:
        """From `pdserve up` options; checks --cpus against the cores this process may use."""
        prefill, decode, collocated = worker_counts(args.prefill, args.decode, args.collocated)
        available = sorted(os.sched_getaffinity(0))
        cpus = tuple(available) if args.cpus is None else parse_cpus(args.cpus)
        missing = sorted(set(cpus) - set(available))
        if missing:
            raise ValueError(f"cores {missing} are not available to this process "
                             f"(available: {','.join(map(str, available))})")
        return cls(model=args.model, num_prefill=prefill, num_decode=decode,
                   num_collocated=collocated, prefill_tp=args.prefill_tp,
                   decode_tp=args.decode_tp, collocated_tp=args.collocated_tp,
                   host=args.host, port=args.port,
                   transport=args.transport, kv_encrypt=args.kv_encrypt,
                   kv_congestion=args.kv_congestion,
                   kv_layerwise=args.kv_layerwise, kv_lease_s=args.kv_lease, dtype=args.dtype,
                   device=args.device, kv_cache_memory=args.kv_cache_memory,
                   max_model_len=args.max_model_len,
                   policy=args.policy, local_prefill_threshold=args.local_prefill_threshold,
                   slo_tpot_s=args.slo_tpot_ms / 1000.0,
                   slo_itl_s=None if args.slo_itl_ms is None else args.slo_itl_ms / 1000.0,
                   leg_timeout_s=args.leg_timeout,
                   elastic=args.elastic, slo_ttft_s=args.slo_ttft_ms / 1000.0,
                   elastic_interval_s=args.elastic_interval_s,
                   elastic_sustain_ticks=args.elastic_sustain_ticks,
                   elastic_cooldown_s=args.elastic_cooldown_s,
                   ready_timeout_s=args.ready_timeout, cpus=cpus,
                   enable_chunked_prefill=args.enable_chunked_prefill,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.max_num_seqs, cpu_kernels=args.cpu_kernels,
                   enforce_eager=args.enforce_eager,
                   secret_file=args.secret_file, serve_public=args.serve_public,
                   metrics_key_file=args.metrics_key_file, api_keys_file=args.api_keys_file,
                   rate_limit=rate_limit_from_args(args), limits=limits_from_args(args),
        admission=admission_from_args(args), log_level=args.log_level)


def worker_counts(prefill: int | None, decode: int | None,
                  collocated: int | None) -> tuple[int, int, int]:
    """(prefill, decode, collocated) from the options given: none -> 1 prefill + 1 decode; only
    one of --prefill/--decode -> the other is 1; --collocated with either -> ValueError."""
    if collocated is not None:
        if prefill is not None or decode is not None:
            raise ValueError("--collocated excludes --prefill and --decode")
        if collocated < 1:
            raise ValueError(f"--collocated must be >= 1, got {collocated}")
        return 0, 0, collocated
    return (1 if prefill is None else prefill), (1 if decode is None else decode), 0


def _split_args(config: UpConfig) -> list[str]:
    """The router's conditional-disaggregation flags, for those not at their defaults."""
    argv = [] if config.local_prefill_threshold is None else \
        ["--local-prefill-threshold", str(config.local_prefill_threshold)]
    if config.slo_tpot_s != UpConfig.slo_tpot_s:
        argv += ["--slo-tpot-ms", f"{config.slo_tpot_s * 1000:g}"]
    return argv


def base_url(host: str, port: int) -> str:
    """The URL a local client uses to reach a server bound to (host, port)."""
    connect = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


def plan_processes(config: UpConfig, secret_file: Path) -> list[ProcessSpec]:
    """Every worker (in worker-index order), then the router last: start them in that order,
    the router only once every worker is healthy."""
    workers = [_worker_spec(config, i, role, secret_file) for i, role in enumerate(config.roles)]
    return [*workers, _router_spec(config, secret_file)]


def worker_cores(config: UpConfig, index: int) -> tuple[int, ...]:
    """The cores worker `index` is pinned to (see the module docstring)."""
    shares = config.tensor_parallel_sizes
    c, n = len(config.cpus), sum(shares)
    first = sum(shares[:index])
    last = first + shares[index]
    if c < n:  # distinct cores, in share order
        return tuple(dict.fromkeys(config.cpus[u % c] for u in range(first, last)))
    return config.cpus[first * c // n : last * c // n]


def worker_url(config: UpConfig, index: int) -> str:
    """Base URL of worker `index` (its health URL is this + /health)."""
    return base_url(config.host, config.port + HTTP_PORT_OFFSET + index)


def worker_name(config: UpConfig, index: int) -> str:
    """'prefill-0', 'decode-1'...: the role and the worker's index among its role."""
    role = config.roles[index]
    return f"{role}-{config.roles[:index].count(role)}"


def planned_ports(config: UpConfig) -> list[tuple[int, str]]:
    """(port, what it is for) of every listener the plan starts: each worker's HTTP and KV
    ports, in worker order, then the router's."""
    ports = []
    for i in range(config.num_workers):
        name = worker_name(config, i)
        ports += [(config.port + HTTP_PORT_OFFSET + i, f"{name} (HTTP)"),
                  (config.port + KV_PORT_OFFSET + i, f"{name} (KV transfers)")]
    return [*ports, (config.port, "router (HTTP)")]


def _worker_spec(config: UpConfig, index: int, role: str, secret_file: Path) -> ProcessSpec:
    launch = WorkerLaunch(
        role=Role(role), model=config.model, device=config.device,
        # once here: every worker alike
        dtype=resolve_dtype(config.dtype, config.device, config.cpu_kernels),
        log_level=config.log_level,
        host=config.host, port=config.port + HTTP_PORT_OFFSET + index,
        kv_port=config.port + KV_PORT_OFFSET + index, transport=config.transport,
        secret_file=secret_file, serve_public=config.serve_public,
        metrics_key_file=config.metrics_key_file, kv_encrypt=config.kv_encrypt,
        kv_congestion=config.kv_congestion,
        kv_layerwise=config.kv_layerwise, cpus=worker_cores(config, index),
        tensor_parallel_size=config.tensor_parallel_sizes[index],
        kv_cache_memory=config.kv_cache_memory, max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs or MAX_NUM_SEQS,
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_lease_s=config.kv_lease_s,
        # a split layout paces local prefills on its decode workers to keep their streams
        # within the target (the capacity the split decision and the elastic controller count
        # on); a collocated-only layout prefills whole prompts unless chunked prefill is asked
        slo_tpot_ms=config.slo_tpot_s * 1000.0 if _splits(config) else None,
        slo_itl_ms=config.slo_itl_s * 1000.0 if _splits(config) and config.slo_itl_s else None,
        # and, above a TPOT target, to the ceiling while a prompt would miss its first token
        slo_ttft_ms=config.slo_ttft_s * 1000.0 if _splits(config) and config.slo_itl_s else None,
        cpu_kernels=config.cpu_kernels, enforce_eager=config.enforce_eager,
        limits=config.limits)
    argv = (sys.executable, "-m", "pdserve.cli", "worker", *worker_argv(launch))
    return ProcessSpec(worker_name(config, index), argv, worker_url(config, index) + "/health",
                       restart=True, signed_health=True)


def _splits(config: UpConfig) -> bool:
    """The layout has prefill workers, so the router may split requests (always with
    --elastic, which may flip a worker to prefill)."""
    return config.elastic or "prefill" in config.roles


def _metrics_key_args(config: UpConfig) -> list[str]:
    return [] if config.metrics_key_file is None else \
        ["--metrics-key-file", str(config.metrics_key_file)]


def _access_args(config: UpConfig) -> list[str]:
    argv = [] if config.api_keys_file is None else ["--api-keys-file", str(config.api_keys_file)]
    if config.rate_limit is not None:
        argv += ["--rate-limit", repr(config.rate_limit.rate),
                 "--rate-burst", str(config.rate_limit.burst)]
    return argv


def _router_spec(config: UpConfig, secret_file: Path) -> ProcessSpec:
    argv = [sys.executable, "-m", "pdserve.cli", "router", "--host", config.host,
            "--port", str(config.port), "--model", config.model, "--policy", config.policy,
            *_split_args(config), *elastic_to_args(config.elastic_settings),
            "--leg-timeout", str(config.leg_timeout_s),
            "--secret-file", str(secret_file),
            *_metrics_key_args(config), *limits_to_args(config.limits), *_access_args(config),
            *admission_to_args(config.admission)]
    if config.log_level != "info":
        argv += ["--log-level", config.log_level]
    for role in ("prefill", "decode", "collocated"):
        urls = [worker_url(config, i) for i, r in enumerate(config.roles) if r == role]
        if urls:
            argv += [f"--{role}", *urls]
    return ProcessSpec("router", tuple(argv), base_url(config.host, config.port) + "/health",
                       signed_health=True)
