"""A child rank (1..N-1) of a tensor-parallel engine, in its own process.

Its life: pin itself to its cores, load its shard of the model and map its KV pool (and map the
shared-memory all-reduce), answer READY (or why loading failed) on its pipe, wait for
CONNECT, join the engine's process group where it has no shared-memory all-reduce, then
run every step rank 0 sends (`StepMessage`) through its model, taking part in the all-reduces,
until rank 0 sends None or goes away (the pipe closes, or a collective fails). It samples
nothing: logits are rank 0's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model.loader import load_model
from pdserve.engine.parallel.collective import Collective, join_store
from pdserve.engine.parallel.cpu_split import pin_rank
from pdserve.engine.parallel.rank_pool import rank_kv_cache
from pdserve.engine.parallel.row_parallel import make_row_parallel
from pdserve.engine.parallel.shard_plan import shard_plan
from pdserve.engine.parallel.shared_pool import SharedPool
from pdserve.engine.parallel.shm_all_reduce import SharedMemoryAllReduce
from pdserve.engine.parallel.step_message import from_message

READY, CONNECT = "ready", "connect"


@dataclass(frozen=True)
class RankSpec:
    config: EngineConfig  # the engine's, resolved (max_model_len set)
    path: Path  # the model folder
    rank: int
    size: int
    cpus: tuple[int, ...]
    store_port: int
    num_blocks: int  # every rank's pool has rank 0's block count
    device: str  # this rank's
    shm_path: str | None  # the shared-memory all-reduce's mapping, or None: a process group
    pool: SharedPool | None  # the KV pool the ranks share, or None: a pool of its own


def rank_main(spec: RankSpec, conn: Connection) -> None:
    pin_rank(spec.cpus)
    parent = os.getppid()
    try:
        model, kv_cache = load_rank(spec)
        shm = None if spec.shm_path is None else SharedMemoryAllReduce(
            spec.shm_path, spec.rank, spec.size, lambda: os.getppid() == parent)
    except Exception as e:  # reported to rank 0, which raises it
        conn.send(f"rank {spec.rank} could not load its shard: {type(e).__name__}: {e}")
        return
    conn.send(READY)
    if _receive(conn) != CONNECT:
        return
    device = torch.device(spec.device)
    make_row_parallel(model, shm or Collective(join_store(spec.store_port, spec.size),
                                               spec.rank, spec.size, device))
    while (msg := _receive(conn)) is not None:
        input_ids, positions, meta = from_message(msg, device)
        model(input_ids, positions, kv_cache, meta)


def load_rank(spec: RankSpec) -> tuple[nn.Module, KVCache]:
    c = spec.config
    cfg = ModelConfig.from_folder(spec.path)
    plan = shard_plan(cfg, spec.size, spec.rank)
    model = load_model(spec.path, cfg, getattr(torch, c.dtype), spec.device, c.max_model_len,
                       c.cpu_kernels, shard=plan)
    try:
        return model, rank_kv_cache(c, cfg, spec.num_blocks, spec.pool, plan)
    finally:
        if spec.pool is not None:
            spec.pool.close()


def _receive(conn: Connection) -> object:
    """The next message; None once rank 0 has gone away."""
    try:
        return conn.recv()
    except EOFError:
        return None
