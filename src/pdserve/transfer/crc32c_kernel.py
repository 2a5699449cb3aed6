"""The Triton kernel of `device_crc32c` (whose docstring states the method). A module of its
own because importing it imports Triton: only a GPU pool's checksums do."""

import triton
import triton.language as tl


@triton.jit
def crc32c_slices_kernel(words_ptr, starts_ptr, columns_ptr, out_ptr,
                         WORDS: tl.constexpr, TILE: tl.constexpr):
    """out[s] = XOR of columns[b * WORDS + w] over the set bits b of word w of slice s, whose
    words start at words_ptr + starts[s]."""
    start = tl.load(starts_ptr + tl.program_id(0))
    acc = tl.zeros([TILE], tl.int32)
    for first in range(0, WORDS, TILE):
        w = first + tl.arange(0, TILE)
        ok = w < WORDS
        word = tl.load(words_ptr + start + w, mask=ok, other=0)  # [TILE] int32
        for b in tl.static_range(32):
            col = tl.load(columns_ptr + b * WORDS + w, mask=ok, other=0)
            acc ^= tl.where(((word >> b) & 1) != 0, col, 0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))
