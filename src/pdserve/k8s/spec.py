"""A DisaggregatedServingCluster's spec as frozen, validated values.

`load_spec` is the way in: the resource's kind, its name, the schema's defaults
(`defaults.py`), the schema itself (`schema_check.py`), then the checks that span fields,
each a ValueError that names the field and what to write instead. Values that the schema
already bounds are not checked twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.cli_args import parse_size
from pdserve.k8s.defaults import with_defaults
from pdserve.k8s.names import API_VERSION, KIND, check_cluster_name
from pdserve.k8s.schema import resource_schema
from pdserve.k8s.schema_check import check_schema
from pdserve.workers.settings import check_kv_congestion


@dataclass(frozen=True)
class ModelSource:
    path: str
    served_model_name: str | None = None
    claim_name: str | None = None  # a PersistentVolumeClaim with the model folder
    host_path: str | None = None  # or a folder on every node
    mount_path: str = "/models"

    def __post_init__(self) -> None:
        if self.claim_name is not None and self.host_path is not None:
            raise ValueError("spec.model.volume: give claimName or hostPath, not both")
        if self.has_volume and not self.path.startswith(self.mount_path.rstrip("/") + "/"):
            raise ValueError(f"spec.model.path {self.path!r} must be inside the volume's "
                             f"mountPath {self.mount_path!r} (e.g. {self.mount_path}/MODEL)")

    @property
    def has_volume(self) -> bool:
        return self.claim_name is not None or self.host_path is not None


@dataclass(frozen=True)
class PoolSpec:
    role: str  # "prefill" | "decode"
    replicas: int
    tensor_parallel_size: int = 1
    kv_cache_memory: str = "512MiB"
    requests: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.tensor_parallel_size < 1:
            raise ValueError(f"spec.{self.role}Pool: replicas must be >= 0 and "
                             "tensorParallelSize >= 1")
        try:
            parse_size(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"spec.{self.role}Pool.kvCacheMemory: {e}") from None


@dataclass(frozen=True)
class Interconnect:
    transport: str = "tcp"
    encryption: bool = False
    congestion: str = ""  # the tcp transport's congestion control ("": the node's)
    hugepages: str | int | None = None  # hugepages-2Mi per worker pod
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"spec.interconnect.blockSize must be a power of two, got "
                             f"{self.block_size}")
        if self.encryption and self.transport != "tcp":
            raise ValueError("spec.interconnect.encryption seals the tcp transport only (NIXL "
                             "moves KV with UCX, unencrypted): set transport: tcp, or "
                             "encryption: false on a private network")
        try:
            check_kv_congestion(self.congestion, self.transport)
        except ValueError as e:
            raise ValueError(f"spec.interconnect.congestion: {e}") from None


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    routing_policy: str = "least_loaded"
    port: int = 8000
    requests: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas != 1:
            raise ValueError(f"spec.router.replicas must be 1, got {self.replicas}: each "
                             "worker registers with one router (--register takes one URL) and "
                             "each router keeps its own pool, so a second router would serve "
                             "with only the workers that happened to reach it")


@dataclass(frozen=True)
class Bounds:
    """How many workers may hold a role at once; `max` None: no bound."""

    role: str
    min: int = 0
    max: int | None = None

    def __post_init__(self) -> None:
        if self.max is not None and self.min > self.max:
            raise ValueError(f"spec.elastic.{self.role}: min ({self.min}) exceeds max "
                             f"({self.max})")

    def holds(self, count: int) -> bool:
        return self.min <= count and (self.max is None or count <= self.max)


@dataclass(frozen=True)
class ElasticSpec:
    enabled: bool = False
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    slo_itl_ms: float | None = None  # the paced prompt steps' ceiling; None: the TPOT target
    prefill: Bounds = field(default_factory=lambda: Bounds("prefill"))
    decode: Bounds = field(default_factory=lambda: Bounds("decode"))

    def __post_init__(self) -> None:
        if self.slo_itl_ms is not None and self.slo_itl_ms < self.slo_tpot_ms:
            raise ValueError(f"spec.elastic.sloItlMs ({self.slo_itl_ms:g}) must be at least "
                             f"sloTpotMs ({self.slo_tpot_ms:g}): a gap at most the ITL bound, "
                             "their mean at most the TPOT bound")

    def bounds(self, role: str) -> Bounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    namespace: str | None
    secret_name: str
    prefill: PoolSpec
    decode: PoolSpec
    image: str = "pdserve:latest"
    pull_policy: str = "IfNotPresent"
    model: ModelSource = field(default_factory=lambda: ModelSource("smollm2"))
    dtype: str = "bfloat16"
    device: str = "cpu"
    interconnect: Interconnect = field(default_factory=Interconnect)
    router: RouterSpec = field(default_factory=RouterSpec)
    elastic: ElasticSpec = field(default_factory=ElasticSpec)

    def __post_init__(self) -> None:
        check_cluster_name(self.name)
        if self.decode.replicas < 1:
            raise ValueError("spec.decodePool.replicas must be at least 1: decode workers "
                             "generate every token (the router serves nothing without one), "
                             "while prefill workers may be 0 (decode workers then prefill)")
        if self.device == "cuda" and self.interconnect.transport == "tcp":
            raise ValueError("spec.interconnect.transport: workers on cuda keep their KV in GPU "
                             "memory, and the tcp transport moves host memory only: use nixl")
        if self.elastic.enabled:
            self._check_bounds()

    @property
    def pools(self) -> tuple[PoolSpec, PoolSpec]:
        return self.prefill, self.decode

    def _check_bounds(self) -> None:
        """Each pool's replicas within its role's bounds: then the bounds can always be met
        (the sum of the minimums is at most the workers, the sum of the maximums at least)."""
        for pool in self.pools:
            bounds = self.elastic.bounds(pool.role)
            if not bounds.holds(pool.replicas):
                raise ValueError(f"spec.{pool.role}Pool.replicas ({pool.replicas}) is outside "
                                 f"spec.elastic.{pool.role} [{bounds.min}, "
                                 f"{'any' if bounds.max is None else bounds.max}]")


def load_spec(resource: Any) -> ClusterSpec:
    """The checked spec of one resource (a dict as read from YAML or the API)."""
    if not isinstance(resource, dict) or resource.get("apiVersion") != API_VERSION \
            or resource.get("kind") != KIND:
        got = (resource.get("apiVersion"), resource.get("kind")) \
            if isinstance(resource, dict) else type(resource).__name__
        raise ValueError(f"expected apiVersion {API_VERSION}, kind {KIND}; got {got}")
    meta = resource.get("metadata") or {}
    name = check_cluster_name(meta.get("name"))
    defaulted = with_defaults(resource, resource_schema())
    check_schema(defaulted)
    s = defaulted["spec"]
    return ClusterSpec(
        name=name, namespace=meta.get("namespace"), secret_name=s["secretName"],
        prefill=_pool("prefill", s["prefillPool"]), decode=_pool("decode", s["decodePool"]),
        image=s["image"], pull_policy=s["imagePullPolicy"], model=_model(s["model"]),
        dtype=s["dtype"], device=s["device"], interconnect=_interconnect(s["interconnect"]),
        router=_router(s["router"]), elastic=_elastic(s["elastic"]))


def _pool(role: str, p: dict[str, Any]) -> PoolSpec:
    resources = p.get("resources", {})
    return PoolSpec(role=role, replicas=p["replicas"],
                    tensor_parallel_size=p["tensorParallelSize"],
                    kv_cache_memory=p["kvCacheMemory"],
                    requests=resources.get("requests", {}), limits=resources.get("limits", {}),
                    node_selector=p.get("nodeSelector", {}),
                    tolerations=tuple(p.get("tolerations", ())))


def _model(m: dict[str, Any]) -> ModelSource:
    volume = m.get("volume", {})
    return ModelSource(path=m["path"], served_model_name=m.get("servedModelName"),
                       claim_name=volume.get("claimName"), host_path=volume.get("hostPath"),
                       mount_path=volume.get("mountPath", "/models"))


def _interconnect(i: dict[str, Any]) -> Interconnect:
    return Interconnect(transport=i["transport"], encryption=i["encryption"],
                        congestion=i.get("congestion", ""), hugepages=i.get("hugepages"),
                        block_size=i["blockSize"])


def _router(r: dict[str, Any]) -> RouterSpec:
    resources = r.get("resources", {})
    return RouterSpec(replicas=r["replicas"], service_type=r["serviceType"],
                      routing_policy=r["routingPolicy"], port=r["port"],
                      requests=resources.get("requests", {}), limits=resources.get("limits", {}))


def _elastic(e: dict[str, Any]) -> ElasticSpec:
    def bounds(role: str) -> Bounds:
        b = e.get(role, {})
        return Bounds(role, min=b.get("min", 0), max=b.get("max"))

    return ElasticSpec(enabled=e["enabled"], slo_ttft_ms=float(e["sloTtftMs"]),
                       slo_tpot_ms=float(e["sloTpotMs"]),
                       slo_itl_ms=None if e.get("sloItlMs") is None else float(e["sloItlMs"]),
                       prefill=bounds("prefill"),
                       decode=bounds("decode"))
