"""CRC32C of (block, layer) slices of a pool in GPU memory, computed on the GPU: only the 4-byte
sums cross to host memory, not the slices (`checksum.slices_crc32c` uses it for a CUDA pool
where Triton is installed).

CRC32C is affine over GF(2) in the message bits: for a message M of n bytes,
  crc(M) = crc(0^n) XOR (XOR over the set bits j of M of col_j),
where col_j is the CRC register (initial value 0, no final XOR) after a message whose only
set bit is j (linearity of the shift register; e.g. Koopman, "32-bit cyclic redundancy codes
for Internet applications", 2002, on CRCs as linear codes). col_j for bit k of byte p is the
register after byte (1 << k) followed by n - 1 - p zero bytes, built once per slice size on
the host (`_columns`), 32 bytes per message byte. A Triton program per slice loads its words,
masks the columns of their set bits and XOR-reduces them; the host XORs in crc(0^n).

The result equals `checksum.crc32c` of the slice's bytes exactly (the tests hold the two
equal on random pools); only the way of computing it differs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.transfer import checksum

log = logging.getLogger(__name__)

# the reflected Castagnoli polynomial (RFC 3720, B.4)
POLY = 0x82F63B78
WORDS_PER_TILE = 256


@functools.cache
def usable(device: str) -> bool:
    """Triton is installed and the kernel gives `checksum.crc32c`'s sums of a small random pool
    on `device`; else False, with a warning saying why (the slices are then staged to host
    memory). Checked once per device."""
    if importlib.util.find_spec("triton") is None:
        return False
    pool = torch.randint(-2**31, 2**31 - 1, (3, 2, 48), dtype=torch.int32, generator=_gen())
    want = checksum.slices_crc32c(pool, [2, 0], [0, 1])  # the host's
    try:
        got = slices_crc32c(pool.to(device), [2, 0], [0, 1])
    except Exception as e:  # a Triton or driver this kernel was not written for
        log.warning("CRC32C on %s failed (%s): a GPU pool's slices are summed on the host",
                    device, e)
        return False
    if got != want:
        log.warning("CRC32C on %s gives other sums than the host's: a GPU pool's slices are "
                    "summed on the host", device)
    return got == want


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def slices_crc32c(pool: torch.Tensor, block_ids: Sequence[int], layers: list[int]) -> list[int]:
    """`checksum.slices_crc32c` of a contiguous pool (on a GPU; a CPU pool runs in Triton's
    interpreter, for the tests), block-major. The ids are checked by the caller."""
    if not len(block_ids) or not layers:
        return []
    size = pool[0, 0].numel() * pool.element_size()
    if size % 4 or not pool.is_contiguous():
        raise ValueError(f"slices of {size} bytes in a {'' if pool.is_contiguous() else 'non-'}"
                         f"contiguous pool: the kernel reads whole 4-byte words")
    words, num_layers = size // 4, pool.shape[1]
    starts = torch.tensor([(b * num_layers + layer) * words for b in block_ids for layer in layers],
                          dtype=torch.int64)
    columns = _columns_on(size, str(pool.device))
    out = torch.empty(len(starts), dtype=torch.int32, device=pool.device)
    from pdserve.transfer.crc32c_kernel import crc32c_slices_kernel

    crc32c_slices_kernel[(len(starts),)](
        pool.view(-1).view(torch.int32), starts.to(pool.device), columns, out,
        WORDS=words, TILE=min(WORDS_PER_TILE, 1 << (words - 1).bit_length()))
    zeros = _zeros_crc(size)
    return [(v & 0xFFFFFFFF) ^ zeros for v in out.cpu().tolist()]


@functools.cache
def _zeros_crc(size: int) -> int:
    return checksum.crc32c(bytes(size))


@functools.cache
def _columns_on(size: int, device: str) -> torch.Tensor:
    """`_columns(size)` on `device`, as int32 (the same bits)."""
    return torch.from_numpy(_columns(size).view(np.int32)).to(device)


def _columns(size: int) -> np.ndarray:
    """[32 * size / 4] uint32, bit-major: entry b * words + w is the column of bit b of the
    little-endian word w (bit b % 8 of byte 4 w + b // 8). Bit-major, so the kernel's loads of
    one bit's columns for consecutive words are consecutive."""
    table = _byte_table()
    cols = np.empty((size, 8), dtype=np.uint32)  # [byte p, bit k]
    c = table[1 << np.arange(8)]  # the last byte: one byte into a zero register
    for p in range(size - 1, -1, -1):
        cols[p] = c
        c = (c >> 8) ^ table[c & 0xFF]  # one more zero byte after it
    # [words, 4 bytes, 8 bits] -> [words, 32 bits] -> [32 bits, words]
    return np.ascontiguousarray(cols.reshape(size // 4, 32).T).reshape(-1)


@functools.cache
def _byte_table() -> np.ndarray:
    """The 256-entry table of the reflected CRC32C (register after one byte from 0)."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(POLY), table >> 1).astype(np.uint32)
    return table
