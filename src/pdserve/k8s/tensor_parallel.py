"""Tensor parallelism in a pool: what the model allows, and what a worker can run.

What is checked, and where the model's shape comes from:
- `smollm2` (shipped in the image): its published config (the planner's preset).
- a model path that exists where render runs (a model folder or a config.json): its config.
- `--model-config PRESET|PATH` (`pdserve k8s render`): that preset or file, for a model that
  lives only inside the cluster.
- otherwise the heads are not checked here (render says so); the worker reads the model's
  config when it starts.

With a known shape, `tensorParallelSize` must split the heads as the engine splits them
(`common/head_split.py`: whole KV heads a rank, or each KV head replicated on TP / KV ranks
that split its query heads evenly). On the CPU a worker's ranks share one KV pool, so prefill
and decode pools may differ in tensor parallelism (the hand-over moves whole-model blocks). On
CUDA each rank keeps its pool on its own device, which the transfer plane does not move, so a
prefill or decode worker refuses `--tensor-parallel-size` > 1 there at start; render refuses
such a pool (a pod that asked for 8 devices and never started would misstate what runs).
"""

from __future__ import annotations

from pathlib import Path

from pdserve.common.head_split import head_split_error
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
    """The engine's rule (`common/head_split.py`); a latent (MLA) model's KV is not split, and
    its query heads go in runs that may differ by one: at most one rank a head."""
    tp = pool.tensor_parallel_size
    if shape.is_mla:
        error = None if tp <= shape.num_heads else (
            f"tensor-parallel size {tp} exceeds the {shape.num_heads} attention heads")
    else:
        error = head_split_error(tp, shape.num_heads, shape.num_kv_heads)
    if error is not None:
        raise ValueError(f"spec.{pool.role}Pool.tensorParallelSize {tp}, {shape.name}: {error}")


def check_worker_tp(pool: PoolSpec, device: str) -> None:
    """ValueError unless the pool's workers can run its tensor parallelism on `device`."""
    tp = pool.tensor_parallel_size
    if tp > 1 and device != "cpu":
        raise ValueError(
            f"spec.{pool.role}Pool.tensorParallelSize is {tp}, but pdserve's {pool.role} "
            f"workers on {device} run one rank: each rank's KV pool is on its own device, and "
            f"the transfer plane does not move such pools yet (on the CPU the ranks share one "
            f"pool, and any size works): set tensorParallelSize: 1, with more replicas for "
            f"more throughput")
