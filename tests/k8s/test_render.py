"""`render`: the manifests a resource becomes. Every one validates against the official
Kubernetes schemas of the newest release kubernetes-validate ships, offline and strict (no
field Kubernetes does not know); the commands in them are ones the pdserve parsers accept; and
what must not render is refused with a message that names the field."""

from __future__ import annotations

import argparse
import copy
import re

import kubernetes_validate
import pytest
import yaml

from pdserve.k8s.reconcile import desired
from pdserve.k8s.render import render
from pdserve.k8s.spec import load_spec
from pdserve.router.app import add_router_parser
from pdserve.workers.settings import launch_from_args
from tests.k8s.resources import EXAMPLES, as_server_would, changed, cpu, gpu, single_device

K8S_VERSION = kubernetes_validate.latest_version()


def _by_key(manifests: list[dict]) -> dict[tuple[str, str], dict]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def _container(manifests: list[dict], deployment: str) -> dict:
    return _by_key(manifests)["Deployment", deployment]["spec"]["template"]["spec"][
        "containers"][0]


def _validate_all(manifests: list[dict]) -> None:
    for m in manifests:
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)


def test_every_manifest_of_the_cpu_example_is_valid_kubernetes() -> None:
    manifests = render(cpu())
    assert sorted(_by_key(manifests)) == [
        ("Deployment", "smollm2-decode"), ("Deployment", "smollm2-prefill"),
        ("Deployment", "smollm2-router"), ("PodDisruptionBudget", "smollm2-decode"),
        ("PodDisruptionBudget", "smollm2-prefill"), ("Service", "smollm2"),
        ("Service", "smollm2-router-internal"), ("Service", "smollm2-workers")]
    _validate_all(manifests)


def test_the_gpu_example_on_one_device_per_worker_is_valid_kubernetes() -> None:
    manifests = render(single_device(gpu()))
    _validate_all(manifests)
    limits = _container(manifests, "llama-70b-prefill")["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1 and limits["hugepages-2Mi"] == "2Gi"


def test_what_the_operator_applies_is_valid_kubernetes_too() -> None:
    resource = as_server_would(cpu())
    _validate_all(desired(resource, load_spec(resource)))  # owner references, annotations


def test_the_operators_own_manifests_are_valid_kubernetes() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "operator.yaml").read_text()))
    _validate_all(docs)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert (container["command"], container["args"]) == (["pdserve"], ["operator"])


def test_the_validator_catches_a_field_kubernetes_does_not_know() -> None:
    deployment = copy.deepcopy(_by_key(render(cpu()))["Deployment", "smollm2-router"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _worker_launch(args: list[str]):
    from pdserve.workers.settings import add_worker_args

    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    assert args[0] == "worker"
    return launch_from_args(parser.parse_args(args[1:]))


def test_workers_register_with_the_router_through_its_internal_service() -> None:
    manifests = render(cpu())
    container = _container(manifests, "smollm2-decode")
    launch = _worker_launch(container["args"])
    assert container["command"] == ["pdserve"]
    assert (launch.role, launch.model, launch.transport) == ("decode", "smollm2", "tcp")
    assert launch.register == "http://smollm2-router-internal:8000"
    assert (launch.host, launch.name) == ("$(POD_IP)", "$(POD_NAME)")
    assert str(launch.secret_file) == "/etc/pdserve/secret/secret"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for e in container["env"]}
    assert env["POD_IP"] == "status.podIP" and env["POD_NAME"] == "metadata.name"
    internal = _by_key(manifests)["Service", "smollm2-router-internal"]["spec"]
    assert internal["publishNotReadyAddresses"] is True  # reachable before workers joined


def test_the_router_command_is_one_the_router_parser_accepts() -> None:
    container = _container(render(single_device(gpu())), "llama-70b-router")
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    args = parser.parse_args(container["args"])
    assert (args.host, args.port, args.policy) == ("0.0.0.0", 8000, "prefix")
    assert (args.model, args.served_model_name) == ("/models/Llama-3.1-70B-Instruct",
                                                    "llama-3.1-70b-instruct")
    assert args.elastic and (args.slo_ttft_ms, args.slo_tpot_ms) == (2000.0, 50.0)
    assert (args.prefill, args.decode) == ([], [])  # every worker registers


def test_probes_use_health_and_the_secret_is_a_mounted_reference() -> None:
    manifests = render(cpu())
    worker = _container(manifests, "smollm2-prefill")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}
    router = _container(manifests, "smollm2-router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["livenessProbe"]["tcpSocket"] == {"port": "http"}
    pod = _by_key(manifests)["Deployment", "smollm2-prefill"]["spec"]["template"]["spec"]
    secret = next(v for v in pod["volumes"] if v["name"] == "cluster-secret")["secret"]
    assert secret["secretName"] == "pdserve-secret"
    assert all(m["kind"] != "Secret" for m in manifests)


def test_pools_scale_and_have_disruption_budgets() -> None:
    manifests = _by_key(render(changed(cpu(), "spec.decodePool.replicas", 5)))
    assert manifests["Deployment", "smollm2-decode"]["spec"]["replicas"] == 5
    pdb = manifests["PodDisruptionBudget", "smollm2-decode"]["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"]["pdserve.dev/pool"] == "decode"


def test_a_pool_of_zero_has_no_disruption_budget() -> None:
    manifests = _by_key(render(changed(cpu(), "spec.prefillPool.replicas", 0)))
    assert manifests["Deployment", "smollm2-prefill"]["spec"]["replicas"] == 0
    assert ("PodDisruptionBudget", "smollm2-prefill") not in manifests


def test_a_model_volume_is_mounted_where_the_path_points() -> None:
    resource = changed(cpu(), "spec.model", {"path": "/models/qwen",
                                             "volume": {"claimName": "models"}})
    manifests = render(resource)
    _validate_all(manifests)
    worker = _container(manifests, "smollm2-decode")
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert _worker_launch(worker["args"]).model == "/models/qwen"


@pytest.mark.parametrize(("path", "value", "message"), [
    ("spec.prefillPool.replicas", -2, "spec.prefillPool.replicas: -2 is less than the minimum"),
    ("spec.interconnect.transport", "infiniband", "spec.interconnect.transport: 'infiniband' "
                                                  "is not one of ['tcp', 'nixl']"),
    ("spec.prefillPool.tensorParallelSize", 4, "spec.prefillPool.tensorParallelSize 4, "
                                               "smollm2-135m: tensor-parallel size 4 does not "
                                               "split 9 attention heads over 3 KV heads"),
    ("spec.decodePool.tensorParallelSize", 3, None),  # CPU ranks share a pool: any split size
    ("spec.decodePool.replicas", 0, "spec.decodePool.replicas must be at least 1"),
    ("spec.router.replicas", 2, "spec.router.replicas must be 1, got 2"),
    ("spec.interconnect.blockSize", 24, "spec.interconnect.blockSize must be a power of two"),
    ("spec.interconnect.encryption", True, None),  # tcp: allowed
    ("spec.interconnect.congestion", "two words", "spec.interconnect.congestion: "
                                                  "--kv-congestion: TcpOptions.congestion must"),
    ("spec.prefillPool.kvCacheMemory", "lots", "spec.prefillPool.kvCacheMemory: cannot read"),
    ("spec.device", "cuda", "spec.interconnect.transport: workers on cuda keep their KV in GPU "
                            "memory"),
    ("spec.prefillPool.resources.limits", {"nvidia.com/gpu": 1}, "spec.prefillPool.resources "
                                                                 "asks for nvidia.com/gpu, but "
                                                                 "spec.device is cpu"),
    ("spec.model", {"path": "/data/m", "volume": {"claimName": "c"}}, "spec.model.path "
                                                                      "'/data/m' must be inside"),
    ("metadata.name", "Big_Name", "metadata.name must be lower-case letters"),
    ("spec.elastic", {"enabled": True, "decode": {"min": 3}}, "spec.decodePool.replicas (2) is "
                                                              "outside spec.elastic.decode "
                                                              "[3, any]"),
])
def test_bad_resources_are_refused_naming_the_field(path: str, value: object,
                                                    message: str | None) -> None:
    resource = changed(cpu(), path, value)
    if message is None:
        render(resource)
        return
    with pytest.raises(ValueError) as e:
        render(resource)
    assert message in str(e.value)


def test_the_gpu_seed_example_is_refused_until_tensor_parallel_pools_move_on_cuda() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "spec.prefillPool.tensorParallelSize is 8, but pdserve's prefill workers on cuda "
            "run one rank")):
        render(gpu())


def test_cpu_pools_of_different_tensor_parallelism_render_their_sizes() -> None:
    resource = changed(changed(cpu(), "spec.prefillPool.tensorParallelSize", 2),
                       "spec.decodePool.tensorParallelSize", 1)
    manifests = render(resource)
    _validate_all(manifests)
    prefill = _worker_launch(_container(manifests, "smollm2-prefill")["args"])
    decode = _worker_launch(_container(manifests, "smollm2-decode")["args"])
    assert (prefill.role, prefill.tensor_parallel_size) == ("prefill", 2)
    assert (decode.role, decode.tensor_parallel_size) == ("decode", 1)


def test_every_worker_paces_its_local_prompts_to_the_clusters_slos() -> None:
    """As `pdserve up` gives a split layout's workers: --slo-tpot-ms always, --slo-itl-ms
    when the resource sets sloItlMs, which must not be under sloTpotMs."""
    plain = render(cpu())
    for pool in ("prefill", "decode"):
        launch = _worker_launch(_container(plain, f"smollm2-{pool}")["args"])
        assert (launch.slo_tpot_ms, launch.slo_itl_ms, launch.slo_ttft_ms) == (100.0, None, None)
    ceiling = render(changed(cpu(), "spec.elastic", {"sloTpotMs": 80, "sloItlMs": 300}))
    _validate_all(ceiling)
    launch = _worker_launch(_container(ceiling, "smollm2-decode")["args"])
    assert (launch.slo_tpot_ms, launch.slo_itl_ms, launch.slo_ttft_ms) == (80.0, 300.0, 2000.0)
    with pytest.raises(ValueError, match=re.escape(
            "spec.elastic.sloItlMs (50) must be at least sloTpotMs (100)")):
        render(changed(cpu(), "spec.elastic", {"sloItlMs": 50}))


def test_the_interconnects_congestion_control_reaches_every_worker() -> None:
    manifests = render(changed(cpu(), "spec.interconnect.congestion", "cubic"))
    _validate_all(manifests)
    for pool in ("prefill", "decode"):
        assert _worker_launch(_container(manifests, f"smollm2-{pool}")["args"]).kv_congestion \
            == "cubic"
    plain = render(cpu())
    assert _worker_launch(_container(plain, "smollm2-decode")["args"]).kv_congestion == ""
    nixl = changed(changed(cpu(), "spec.interconnect.transport", "nixl"),
                   "spec.interconnect.congestion", "cubic")
    with pytest.raises(ValueError, match=re.escape(
            "spec.interconnect.congestion: --kv-congestion sets the tcp transport's "
            "connections only")):
        render(nixl)


def test_a_preset_checks_the_heads_of_a_model_that_is_not_here() -> None:
    resource = changed(gpu(), "spec.decodePool.tensorParallelSize", 24)
    with pytest.raises(ValueError, match=re.escape(
            "tensor-parallel size 24 does not split 64 attention heads over 8 KV heads")):
        render(resource, model_config="llama-3.1-70b")


def test_an_mla_model_splits_its_query_heads_in_any_runs_up_to_one_a_rank() -> None:
    resource = changed(cpu(), "spec.prefillPool.tensorParallelSize", 3)  # 128 heads: uneven
    render(resource, model_config="deepseek-v3")
    with pytest.raises(ValueError, match="tensor-parallel size 200 exceeds the 128 attention "
                                         "heads"):
        render(changed(resource, "spec.prefillPool.tensorParallelSize", 200),
               model_config="deepseek-v3")


def test_a_local_model_folder_is_read_for_its_heads(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 96, '
        '"intermediate_size": 128, "num_attention_heads": 12, "num_key_value_heads": 3, '
        '"vocab_size": 100}')
    resource = changed(cpu(), "spec.model.path", str(tmp_path))
    render(resource)
    for tp in (4, 5):
        with pytest.raises(ValueError, match=f"tensor-parallel size {tp} does not split 12 "
                                             f"attention heads over 3 KV heads"):
            render(changed(resource, "spec.prefillPool.tensorParallelSize", tp))
    render(changed(resource, "spec.prefillPool.tensorParallelSize", 6))  # 2 ranks a KV head
