"""CRC32C (Castagnoli) over (block, layer) slices of a KV pool, read in place.

A pool is a contiguous tensor whose first two dimensions are [num_blocks, num_layers]
(`KVCache.data`); whatever follows is one (block, layer) slice, a contiguous run of bytes.
Checksums of a CPU pool read those bytes through a zero-copy, read-only memoryview of the
tensor's storage: nothing is staged. A CUDA pool's slices are summed on its GPU
(`device_crc32c`, where Triton is installed and the kernel passes its check), else copied to
host memory first. The view lives only for the call; the caller guarantees that no writer
touches the slices while they are summed (a checksum of bytes being written is meaningless).

Implementation: `fastcrc` (Rust, hardware-accelerated, MIT), chosen by measurement on this
machine: ~25 GB/s on a 23 MB payload in cache, ~15 GB/s from DRAM, ~17 GB/s as 12 KiB slices
(`zlib.crc32`, another polynomial, ~5 GB/s). It reads any buffer without copying, releases the
GIL, and chains (`crc32c(b, crc32c(a)) == crc32c(a + b)`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from fastcrc import crc32 as _fastcrc32

# CRC32C("123456789"): the standard check value of the Castagnoli polynomial (iSCSI, RFC 3720).
CHECK_VALUE = 0xE3069283

BytesLike = bytes | bytearray | memoryview


def crc32c(data: BytesLike, value: int = 0) -> int:
    """CRC32C of `data`, continuing from the CRC32C `value` of the bytes before it."""
    return _fastcrc32.iscsi(data, value)


def pool_bytes(pool: torch.Tensor) -> memoryview:
    """Read-only, zero-copy, 1-D byte view of a contiguous CPU pool tensor.

    Valid while `pool` is alive; it aliases the pool, so later writes show through it.
    """
    if pool.device.type != "cpu":
        raise ValueError(
            f"checksums read host memory; the pool is on {pool.device} (stage it to CPU first)"
        )
    if pool.dim() < 2:
        raise ValueError(f"a pool is [num_blocks, num_layers, ...]; got shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("the pool tensor must be contiguous for slices to be byte ranges")
    return memoryview(pool.view(torch.uint8).numpy()).cast("B").toreadonly()


def slice_nbytes(pool: torch.Tensor) -> int:
    """Bytes of one (block, layer) slice."""
    return pool[0, 0].numel() * pool.element_size()


def slice_range(pool: torch.Tensor, block_id: int, layer: int) -> tuple[int, int]:
    """[start, end) byte offsets of slice (block_id, layer) inside the pool's storage view."""
    num_blocks, num_layers = pool.shape[0], pool.shape[1]
    if not 0 <= block_id < num_blocks:
        raise ValueError(f"block id {block_id} is outside the pool's {num_blocks} blocks")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is outside the pool's {num_layers} layers")
    size = slice_nbytes(pool)
    start = (block_id * num_layers + layer) * size
    return start, start + size


def slice_crc32c(pool: torch.Tensor, block_id: int, layer: int) -> int:
    """CRC32C of the bytes of one (block, layer) slice as they are now in the pool."""
    return slices_crc32c(pool, [block_id], [layer])[0]


def slices_crc32c(
    pool: torch.Tensor, block_ids: Sequence[int], layers: Iterable[int]
) -> list[int]:
    """CRC32C of every (block, layer) slice, block-major: for each block, each layer in order.

    This order is the wire order of `TransferDescriptor.checksums` and
    `CompletionNotice.checksums` (index = block_index * num_layers_in_range + layer_index).
    """
    layer_list = list(layers)
    if len(block_ids) and layer_list:  # validate the extremes once, not every slice
        slice_range(pool, min(block_ids), min(layer_list))
        slice_range(pool, max(block_ids), max(layer_list))
    if pool.device.type == "cuda":
        from pdserve.transfer import device_crc32c  # imports this module

        if device_crc32c.usable(str(pool.device)):
            return device_crc32c.slices_crc32c(pool, block_ids, layer_list)
        return _staged_crc32c(pool, block_ids, layer_list)
    view, size, num_layers = pool_bytes(pool), slice_nbytes(pool), pool.shape[1]
    out: list[int] = []
    for block_id in block_ids:
        base = block_id * num_layers
        for layer in layer_list:
            start = (base + layer) * size
            out.append(crc32c(view[start : start + size]))
    return out


def _staged_crc32c(pool: torch.Tensor, block_ids: Sequence[int], layers: list[int]) -> list[int]:
    """Same as `slices_crc32c`, for a pool in GPU memory: the slices are gathered on the GPU
    and copied to host memory in one transfer (`.cpu()` waits for the copy, and for the
    kernels before it on the current stream), then summed there. The copy is the transfer's
    size again over PCIe: only where the GPU's own kernel (`device_crc32c`) cannot run."""
    if not len(block_ids) or not layers:
        return []
    dev = pool.device
    rows = pool.index_select(0, torch.tensor(list(block_ids), device=dev))
    host = rows.index_select(1, torch.tensor(layers, device=dev)).cpu()  # [B, L, ...] contiguous
    view, size = pool_bytes(host), slice_nbytes(host)
    return [crc32c(view[i * size : (i + 1) * size]) for i in range(len(block_ids) * len(layers))]
