"""The OpenAPI v3 schema of a DisaggregatedServingCluster: what the API server accepts and
defaults, and what `pdserve k8s render` checks and defaults the same way (`defaults.py`,
`schema_check.py`), so a resource means the same with and without the operator.

The schema is structural (every field typed; quantities are int-or-string), as the API server
requires of a CRD. Checks that span fields (min <= max, tensor parallelism against the
model's heads, the transport against the device) are `spec.py`'s and `model_heads.py`'s.
"""

from __future__ import annotations

from typing import Any

from pdserve.common.engine_options import DTYPE_NAMES
from pdserve.router.policies import PolicyName
from pdserve.workers.settings import TransportName

Schema = dict[str, Any]

# Kubernetes' resource.Quantity, as its own OpenAPI documents it.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DEVICES = ("cpu", "cuda")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DEFAULT_IMAGE = "pdserve:latest"
DEFAULT_ROUTER_PORT = 8000


def _obj(properties: dict[str, Schema], required: tuple[str, ...] = (), description: str = "",
         **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    return schema


def _str(description: str = "", **extra: Any) -> Schema:
    return {"type": "string", **({"description": description} if description else {}), **extra}


def _int(description: str = "", **extra: Any) -> Schema:
    return {"type": "integer", **({"description": description} if description else {}), **extra}


def _enum(values: tuple[str, ...], default: str, description: str) -> Schema:
    return _str(description, enum=list(values), default=default)


def quantity(description: str = "") -> Schema:
    return {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
            **({"description": description} if description else {})}


def _resources() -> Schema:
    quantities = {"type": "object", "additionalProperties": quantity()}
    return _obj({"requests": quantities, "limits": quantities},
                description="the pod's container resources, as in a Pod (cpu, memory, "
                            "nvidia.com/gpu, ...)")


def _tolerations() -> Schema:
    toleration = _obj({
        "key": _str(), "operator": _str(enum=["Exists", "Equal"]), "value": _str(),
        "effect": _str(enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": _int()})
    return {"type": "array", "items": toleration}


def _pool(role: str) -> Schema:
    return _obj({
        "replicas": _int(f"{role} workers (pods); 0 leaves the role to the other pool",
                         minimum=0),
        "tensorParallelSize": _int("devices one worker shards the model over; must divide "
                                   "the model's attention heads", minimum=1, default=1),
        "kvCacheMemory": _str("each worker's KV pool, e.g. 512MiB or 40GiB",
                              default="512MiB", minLength=1),
        "resources": _resources(),
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": _tolerations(),
    }, required=("replicas",), description=f"the {role} workers")


def _model() -> Schema:
    volume = _obj({
        "claimName": _str("a PersistentVolumeClaim holding the model folder"),
        "hostPath": _str("a folder on every node holding the model folder"),
        "mountPath": _str("where the volume appears in the containers", default="/models"),
    }, description="where the model folder comes from (exactly one of claimName, hostPath)")
    return _obj({
        "path": _str("'smollm2' (shipped in the image) or the Hugging Face model folder "
                     "inside the containers", default="smollm2", minLength=1),
        "servedModelName": _str("the name clients give as 'model' (default: path)",
                                minLength=1),
        "volume": volume,
    }, default={})


def _interconnect() -> Schema:
    return _obj({
        "transport": _enum(tuple(t.value for t in TransportName), TransportName.TCP.value,
                           "how KV moves between workers"),
        "encryption": {"type": "boolean", "default": False,
                       "description": "seal KV transfers with AES-256-GCM (tcp only)"},
        "congestion": _str("TCP congestion control for the KV connections (tcp only), e.g. "
                           "cubic (default: the node's)", minLength=1),
        "hugepages": quantity("2 MiB huge pages reserved per worker pod (hugepages-2Mi), "
                              "mounted at /dev/hugepages"),
        "blockSize": _int("tokens per KV block, a power of two", minimum=1, default=16),
    }, default={})


def _router() -> Schema:
    return _obj({
        "replicas": _int("router pods", minimum=1, default=1),
        "serviceType": _enum(SERVICE_TYPES, "ClusterIP", "the client Service's type"),
        "routingPolicy": _enum(tuple(p.value for p in PolicyName),
                               PolicyName.LEAST_LOADED.value, "how the router picks a worker"),
        "port": _int("the router's port", minimum=1, maximum=65535,
                     default=DEFAULT_ROUTER_PORT),
        "resources": _resources(),
    }, default={})


def _bounds(role: str) -> Schema:
    return _obj({"min": _int(minimum=0), "max": _int(minimum=0)},
                description=f"how many workers may hold the {role} role at once")


def _elastic() -> Schema:
    positive = {"type": "number", "minimum": 0, "exclusiveMinimum": True}
    return _obj({
        "enabled": {"type": "boolean", "default": False,
                    "description": "the router flips workers between prefill and decode"},
        "sloTtftMs": {**positive, "default": 2000, "description": "time to first token to keep"},
        "sloTpotMs": {**positive, "default": 100, "description": "time per output token to keep"},
        "sloItlMs": {**positive, "description": "longest gap between two tokens of a stream: "
                     "a decode worker's paced prompt steps may run to it while its streams' "
                     "mean stays within sloTpotMs (default: sloTpotMs)"},
        "prefill": _bounds("prefill"),
        "decode": _bounds("decode"),
    }, default={})


def spec_schema() -> Schema:
    return _obj({
        "image": _str("the pdserve image", default=DEFAULT_IMAGE, minLength=1),
        "imagePullPolicy": _enum(PULL_POLICIES, "IfNotPresent", "the containers' pull policy"),
        "secretName": _str("the Secret whose key 'secret' holds the cluster secret (at least "
                           "16 bytes)", minLength=1),
        "model": _model(),
        "dtype": _enum(DTYPE_NAMES, "bfloat16", "weights and KV cache dtype"),
        "device": _enum(DEVICES, "cpu", "where every worker computes"),
        "interconnect": _interconnect(),
        "prefillPool": _pool("prefill"),
        "decodePool": _pool("decode"),
        "router": _router(),
        "elastic": _elastic(),
    }, required=("secretName", "prefillPool", "decodePool"))


def _condition() -> Schema:
    return _obj({"type": _str(), "status": _str(enum=["True", "False", "Unknown"]),
                 "reason": _str(), "message": _str(),
                 "lastTransitionTime": _str(format="date-time"),
                 "observedGeneration": _int()}, required=("type", "status"))


def status_schema() -> Schema:
    pool = _obj({"replicas": _int(), "readyWorkers": _int()})
    return _obj({
        "observedGeneration": _int(),
        "prefillPool": pool,
        "decodePool": pool,
        "router": _obj({"replicas": _int(), "readyReplicas": _int()}),
        "roles": _obj({"prefill": _int(), "decode": _int()},
                      description="ready workers by the role they serve now"),
        "conditions": {"type": "array", "items": _condition()},
    })


def resource_schema() -> Schema:
    """The openAPIV3Schema of the CRD's one version."""
    return _obj({"apiVersion": _str(), "kind": _str(), "metadata": {"type": "object"},
                 "spec": spec_schema(), "status": status_schema()}, required=("spec",))
