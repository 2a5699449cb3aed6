"""The KV pool every rank of a CPU tensor-parallel engine maps: one memory file, shared.

Why one pool and not one per rank: the pool stays a whole model's pool, every KV head of a
(block, layer) slice side by side, exactly the layout of a one-process engine. The transfer
plane in rank 0's process reads and writes it as it would any pool, so a prefill worker at
tensor-parallel size N hands KV to a decode worker at any size M (each rank reads and writes
only its heads' rows of each slot; a KV head replicated on several ranks is written by each
with the same values, since every rank computes it from the same summed hidden state).

The memory is an anonymous memory file (`memfd_create`): not a file under /dev/shm, whose
size containers often cap at 64 MiB. Its pages are allocated at creation (`posix_fallocate`,
which fails cleanly when the memory is not there) and asked for huge pages, which the kernel
gives where `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows (`advise` or
`always`; with `never` the pool is on small pages).

Lifetime: the memory lives while any process maps it. Rank 0 creates it; each child rank
receives the file descriptor when it is started (pickling a `SharedPool` while a child is
being spawned passes the descriptor to it) and maps it; `close()` drops rank 0's
descriptor once every child has been started, and the tensors keep their mappings.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
from multiprocessing.reduction import DupFd
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


class SharedPool:
    def __init__(self, nbytes: int, fd: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"a shared KV pool needs a positive size, got {nbytes} bytes")
        self.nbytes = nbytes
        if fd is not None:
            self._fd: int | None = fd
            return
        if not shmem_huge_pages(_read(SHMEM_THP)):
            log.warning("the KV pool the tensor-parallel ranks share is on small pages: the "
                        "kernel gives shared memory no huge pages (%s is 'never' or 'deny'); "
                        "as root, `echo advise > %s` (a 2,048-token prefill at TP 2 ran ~1.2x "
                        "faster with it on the development machine)", SHMEM_THP, SHMEM_THP)
        self._fd = os.memfd_create("pdserve-kv-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as e:
            self.close()
            raise ValueError(f"could not allocate the {nbytes / 2**30:.2f} GiB KV pool shared by "
                             f"the tensor-parallel ranks ({e.strerror}); give less KV memory "
                             f"(--kv-cache-gb) or free some") from None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` over the whole pool (zeros until written), mapped anew: writes
        through it are seen by every process that maps the pool."""
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if want != self.nbytes:
            raise ValueError(f"a {list(shape)} {dtype} pool is {want} bytes; this one is "
                             f"{self.nbytes}")
        if self._fd is None:
            raise ValueError("the shared KV pool's descriptor was closed; map it before close()")
        mapping = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED)
        with contextlib.suppress(OSError):  # shmem huge pages off: small pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)

    def close(self) -> None:
        """Drop this process's descriptor (idempotent); mapped tensors stay valid."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Only while a child is being spawned: DupFd hands the descriptor to that child.
        if self._fd is None:
            raise ValueError("the shared KV pool's descriptor was closed before the ranks "
                             "started")
        return _attach, (DupFd(self._fd), self.nbytes)


def _attach(fd: Any, nbytes: int) -> SharedPool:
    return SharedPool(nbytes, fd.detach())


def shmem_huge_pages(setting: str | None) -> bool:
    """Whether the kernel may back a shared mapping with huge pages, from the text of
    `SHMEM_THP` (the chosen value in brackets, e.g. "always within_size advise [never] deny
    force"); True when unknown (no such file: another OS, or a kernel without THP)."""
    if setting is None:
        return True
    return not ("[never]" in setting or "[deny]" in setting)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
