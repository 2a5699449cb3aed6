"""The all-reduce of CPU ranks on one x86-64 machine, through one shared mapping.

gloo over loopback TCP took 1.1-1.7 ms for a decode step's [1, 576] and 4.2 ms for a
2,048-token prefill's [2048, 576] bf16 here; a step has two a layer (SmolLM2: 60), so decode
on 2 ranks ran 10x slower than on one. Through shared memory: each rank copies its partial
sum into its slot, raises its counter, waits (spinning, then yielding its core) until every
rank's counter has reached the same call, and adds the slots in rank order into its own
tensor, so every rank gets the same bits. Slots alternate between two buffers from one call
to the next: a rank can be one call ahead of another (reading the other buffer), never two,
since each call waits for every rank to arrive. Tensors larger than a slot go in pieces.

Ordering rests on x86-64's: stores become visible in program order (data before counter) and
loads are not reordered with older loads (counter before data). Elsewhere the ranks use
gloo (`collective.py`).

The mapping is a file in /dev/shm that rank 0 creates, every rank maps, and rank 0 unlinks
once every rank has mapped it (or when the engine goes away).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable

import torch

from pdserve.engine.parallel.collective import TIMEOUT

SLOT_BYTES = 4 * 2**20
LINE = 64  # one cache line per rank's counter
SPINS = 2000  # waits this many polls before yielding its core each poll
CHECK_EVERY = 256  # polls between checks that the other ranks live and time is left


def uses_shared_memory(device: str) -> bool:
    return torch.device(device).type == "cpu" and platform.machine() in ("x86_64", "AMD64")


def create_mapping(size: int) -> str:
    """A zeroed file for `size` ranks in /dev/shm (else the temporary folder); its path."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="pdserve-tp-", dir=folder)
    os.ftruncate(fd, _mapping_bytes(size))
    os.close(fd)
    return path


class SharedMemoryAllReduce:
    """`alive()`: whether the ranks this one waits for can still arrive (checked while it
    waits); a wait ends in RuntimeError when they cannot, or after `collective.TIMEOUT`."""

    def __init__(self, path: str, rank: int, size: int, alive: Callable[[], bool]) -> None:
        self.rank, self.size, self.alive = rank, size, alive
        self.buf = torch.from_file(path, shared=True, size=_mapping_bytes(size),
                                   dtype=torch.uint8)
        self.counters = self.buf[: size * LINE].view(torch.int64)[:: LINE // 8]
        self.calls = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` (contiguous) over the ranks, in place; every rank gets the same bits."""
        flat = t.view(-1)
        per_slot = SLOT_BYTES // t.element_size()
        for start in range(0, flat.numel(), per_slot):
            self._reduce(flat[start : start + per_slot])
        return t

    def _reduce(self, piece: torch.Tensor) -> None:
        self.calls += 1
        slots = [self._slot(r, piece) for r in range(self.size)]
        slots[self.rank].copy_(piece)
        self.counters[self.rank] = self.calls
        self._wait(self.calls)
        torch.add(slots[0], slots[1], out=piece)
        for slot in slots[2:]:
            piece.add_(slot)

    def _slot(self, rank: int, piece: torch.Tensor) -> torch.Tensor:
        offset = self.size * LINE + ((self.calls % 2) * self.size + rank) * SLOT_BYTES
        nbytes = piece.numel() * piece.element_size()
        return self.buf[offset : offset + nbytes].view(piece.dtype)

    def _wait(self, call: int) -> None:
        polls, deadline = 0, time.monotonic() + TIMEOUT.total_seconds()
        while int(self.counters.min()) < call:
            polls += 1
            if polls > SPINS:
                time.sleep(0)
            if polls % CHECK_EVERY == 0:
                if not self.alive():
                    raise RuntimeError("a tensor-parallel rank exited during an all-reduce")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a tensor-parallel rank did not reach an all-reduce "
                                       f"within {TIMEOUT.total_seconds():.0f} s")


def _mapping_bytes(size: int) -> int:
    return size * LINE + 2 * size * SLOT_BYTES
