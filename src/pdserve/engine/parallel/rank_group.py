"""Rank 0's side of a tensor-parallel engine: the child ranks, their pipes, the collective.

Lifetime: started in the engine's constructor before rank 0 loads its own shard (the ranks
load at the same time), `connect`ed once rank 0's model is loaded, `close`d by
`Engine.close()`; when the group is garbage-collected or the interpreter exits the children
are stopped too, and a child whose rank 0 dies sees its pipe close and exits. Stopping takes
at most STOP_WAIT_S + KILL_WAIT_S per child.

A child that exits (or a step that fails part-way, leaving the ranks out of step) makes that
step and every later one raise `RankFailed`: a gloo collective fails at once when a peer's
sockets close, and `Collective.TIMEOUT` bounds the wait for a peer that hangs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
from torch import nn

from pdserve.config import EngineConfig
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.parallel.collective import Collective, open_store
from pdserve.engine.parallel.cpu_split import pin, split_cpus, unpin
from pdserve.engine.parallel.rank_process import CONNECT, READY, RankSpec, rank_main
from pdserve.engine.parallel.row_parallel import make_row_parallel
from pdserve.engine.parallel.shared_pool import SharedPool
from pdserve.engine.parallel.shm_all_reduce import (
    SharedMemoryAllReduce,
    create_mapping,
    uses_shared_memory,
)
from pdserve.engine.parallel.step_message import to_message

STOP_WAIT_S = 5.0  # a child's time to leave its loop once told to stop
KILL_WAIT_S = 2.0  # then after SIGTERM, before SIGKILL
EXIT_WAIT_S = 1.0  # after a failed step, for a dying child's exit to be seen


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel engine exited, or the ranks fell out of step: the engine
    cannot compute further steps; close it and start a new one."""


class RankGroup:
    def __init__(self, config: EngineConfig, path: Path, num_blocks: int,
                 pool: SharedPool | None) -> None:
        """`pool`: the KV pool the ranks share (CPU), or None: each rank allocates its own."""
        size = config.tensor_parallel_size
        shares = split_cpus(sorted(os.sched_getaffinity(0)), size)
        self._store = open_store(size)
        self._shm_path = create_mapping(size) if uses_shared_memory(config.device) else None
        self._unlink = weakref.finalize(self, _unlink, self._shm_path)
        ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(1, size):
            spec = RankSpec(config, Path(path), rank, size, shares[rank], self._store.port,
                            num_blocks, rank_device(config.device, rank), self._shm_path, pool)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(spec, theirs), daemon=True,
                               name=f"pdserve-tp-rank-{rank}")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        self._stop = weakref.finalize(self, _stop_children, self._procs, self._conns)
        self._unpin: tuple[set[int], int] | None = pin(shares[0])
        self._failure: str | None = None
        self.size = size

    @property
    def pids(self) -> list[int]:
        """The child ranks' process ids (ranks 1..N-1)."""
        return [p.pid for p in self._procs]

    def connect(self, model: nn.Module, device: torch.device) -> None:
        """Once rank 0's shard is loaded: wait for every child's, join the process group, make
        rank 0's row-parallel linears sum over it."""
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            while not conn.poll(0.2) and proc.is_alive():
                pass
            try:
                reply = conn.recv()
            except EOFError:
                proc.join(EXIT_WAIT_S)
                raise RankFailed(f"tensor-parallel rank {rank} {_exit_text(proc)} while loading "
                                 f"its shard (a script that builds a tensor-parallel engine at "
                                 f"import needs the `if __name__ == '__main__':` guard: the "
                                 f"ranks start by importing it)") from None
            if reply != READY:
                raise RankFailed(str(reply))
        for conn in self._conns:
            conn.send(CONNECT)
        if self._shm_path is None:
            make_row_parallel(model, Collective(self._store, 0, self.size, device))
            return
        procs = self._procs
        shm = SharedMemoryAllReduce(self._shm_path, 0, self.size,
                                    lambda: all(p.is_alive() for p in procs))
        self._unlink()  # every rank has it mapped
        make_row_parallel(model, shm)

    @contextlib.contextmanager
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> Iterator[None]:
        """Sends the step to every child; the body runs rank 0's forward."""
        if self._failure is not None:
            raise RankFailed(self._failure)
        msg = to_message(input_ids, positions, meta)
        try:
            for conn in self._conns:
                conn.send(msg)
            yield
        except Exception as e:
            dead = self._dead_rank()
            self._failure = dead or (f"a step failed part-way ({type(e).__name__}: {e}), "
                                     f"leaving the tensor-parallel ranks out of step; close "
                                     f"this engine and start a new one")
            if dead is not None:
                raise RankFailed(dead) from e
            raise

    def check(self) -> None:
        """Raise RankFailed if a child rank has exited (or a step failed part-way): between
        steps, so that an idle engine learns it cannot compute before a request finds out."""
        if self._failure is None:
            self._failure = self._dead_rank(wait_s=0.0)
        if self._failure is not None:
            raise RankFailed(self._failure)

    def _dead_rank(self, wait_s: float = EXIT_WAIT_S) -> str | None:
        for rank, proc in enumerate(self._procs, 1):
            proc.join(wait_s)
            if not proc.is_alive():
                return (f"tensor-parallel rank {rank} (pid {proc.pid}) {_exit_text(proc)}; "
                        f"this engine cannot compute further steps: close it and start a "
                        f"new one")
        return None

    def close(self) -> None:
        """Stop every child (bounded wait) and give rank 0's thread its cores back."""
        self._stop()
        if self._unpin is not None:
            unpin(self._unpin)
            self._unpin = None


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU, or the r-th CUDA device after the engine's own."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + rank}"


def _exit_text(proc: BaseProcess) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _stop_children(procs: list[BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(None)
        conn.close()
    for proc in procs:
        proc.join(STOP_WAIT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(KILL_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
