"""Tensor parallelism in a pool: what the model allows, and what a worker can run.

What is checked, and where the model's shape comes from:
- `smollm2` (shipped in the image): its published config (the planner's preset).
- a model path that exists where render runs (a model folder or a config.json): its config.
- `--model-config PRESET|PATH` (`pdserve k8s render`): that preset or file, for a model that
  lives only inside the cluster.
- otherwise the heads are not checked here (render says so); the worker reads the model's
  config when it starts.

With a known shape, `tensorParallelSize` must divide the attention heads, and the KV heads
must divide among the ranks or be replicated over them (TP a multiple of the KV heads), as in
vLLM. Workers run `--tensor-parallel-size` only collocated: a prefill or decode worker refuses
it at start, since the KV hand-over between pools of different tensor parallelism is not
built. So render refuses a pool with `tensorParallelSize` > 1 (a pod that asked for 8 devices
and never started would misstate what runs).
"""

from __future__ import annotations

from pathlib import Path

from pdserve.k8s.spec import PoolSpec
from pdserve.planner.model_shape import ModelShape, load_model_shape

SMOLLM2_PRESET = "smollm2-135m"


def model_shape(path: str, model_config: str | None = None) -> ModelShape | None:
    """The model's shape from the sources above, or None when none is at hand."""
    from pdserve.common.smollm2 import SMOLLM2_ALIASES

    if model_config is not None:
        return load_model_shape(model_config)
    if path.lower() in SMOLLM2_ALIASES:
        return load_model_shape(SMOLLM2_PRESET)
    if Path(path).exists():
        return load_model_shape(path)
    return None


def check_heads(pool: PoolSpec, shape: ModelShape) -> None:
    tp, heads = pool.tensor_parallel_size, shape.num_heads
    where = f"spec.{pool.role}Pool.tensorParallelSize {tp}"
    if heads % tp:
        raise ValueError(f"{where} does not divide the {heads} attention heads of "
                         f"{shape.name}: use a divisor of {heads}")
    kv = shape.num_kv_heads
    if not shape.is_mla and kv % tp and tp % kv:
        raise ValueError(f"{where} neither divides the {kv} KV heads of {shape.name} nor is a "
                         f"multiple of them")


def tp_args(pool: PoolSpec) -> list[str]:
    """The worker options that ask for the pool's tensor parallelism (none for 1)."""
    tp = pool.tensor_parallel_size
    if tp == 1:
        return []
    raise ValueError(f"spec.{pool.role}Pool.tensorParallelSize is {tp}, but pdserve workers "
                     f"do not run tensor parallelism yet in a {pool.role} pool (only "
                     "collocated workers do: the KV hand-over between pools of different "
                     "tensor parallelism is not built): set tensorParallelSize: 1, with more "
                     "replicas for more throughput")
