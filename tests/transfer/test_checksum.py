"""CRC32C: standard vectors, a bitwise reference, chaining, and zero-copy pool slices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transfer.checksum import (
    CHECK_VALUE,
    _staged_crc32c,
    crc32c,
    pool_bytes,
    slice_crc32c,
    slice_nbytes,
    slice_range,
    slices_crc32c,
)


def _reference_crc32c(data: bytes) -> int:
    """Bit-at-a-time CRC32C (reflected polynomial 0x82F63B78): slow, obviously right."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _pool(num_blocks: int = 5, layers: int = 3, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, layers, 2, 4, 2, 8, generator=gen).to(dtype)


def test_standard_check_value():
    assert crc32c(b"123456789") == CHECK_VALUE == 0xE3069283


@pytest.mark.parametrize(
    ("data", "expected"),
    [  # RFC 3720 appendix B.4
        (bytes(32), 0x8A9136AA),
        (b"\xff" * 32, 0x62A8AB43),
        (bytes(range(32)), 0x46DD794E),
        (bytes(range(31, -1, -1)), 0x113FDB5C),
        (b"", 0),
    ],
)
def test_rfc3720_vectors(data, expected):
    assert crc32c(data) == expected


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_matches_reference_and_chains(a, b):
    assert crc32c(a) == _reference_crc32c(a)
    assert crc32c(b, crc32c(a)) == crc32c(a + b)


def test_pool_bytes_is_a_zero_copy_alias():
    pool = _pool()
    view = pool_bytes(pool)
    assert view.readonly and len(view) == pool.numel() * pool.element_size()
    before = slice_crc32c(pool, 2, 1)
    pool[2, 1].view(torch.uint8).view(-1)[0] ^= 0x01  # write through the tensor...
    assert slice_crc32c(pool, 2, 1) != before  # ...and the view sees it: no staged copy
    assert view[slice(*slice_range(pool, 2, 1))] == pool[2, 1].view(torch.uint8).numpy().tobytes()


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.integers(1, 6),
    st.integers(1, 4),
    st.data(),
)
def test_slice_crc_matches_the_slice_bytes(dtype, num_blocks, layers, data):
    pool = _pool(num_blocks, layers, dtype, seed=data.draw(st.integers(0, 1000)))
    block = data.draw(st.integers(0, num_blocks - 1))
    layer = data.draw(st.integers(0, layers - 1))
    raw = pool[block, layer].contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) == slice_nbytes(pool)
    assert slice_crc32c(pool, block, layer) == crc32c(raw)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=5, unique=True), st.integers(0, 2),
       st.integers(1, 3))
def test_many_slices_are_block_major(block_ids, begin, width):
    pool = _pool()
    layers = range(begin, min(begin + width, 3))
    expected = [slice_crc32c(pool, b, layer) for b in block_ids for layer in layers]
    assert slices_crc32c(pool, block_ids, layers) == expected


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=5, unique=True),
       st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
def test_staged_slices_sum_like_the_pool_in_place(block_ids, layers):
    """A CUDA pool's path (gather, copy to host, sum) gives the in-place sums, in their order;
    run here on a CPU pool, and on the GPU in tests/engine/test_cuda.py."""
    pool = _pool()
    assert _staged_crc32c(pool, block_ids, layers) == slices_crc32c(pool, block_ids, layers)


def test_one_flipped_bit_changes_only_its_slice():
    pool = _pool()
    before = slices_crc32c(pool, range(5), range(3))
    pool[3, 2].view(torch.uint8).view(-1)[17] ^= 0x80
    after = slices_crc32c(pool, range(5), range(3))
    changed = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
    assert changed == [3 * 3 + 2]


@pytest.mark.parametrize(("block", "layer"), [(-1, 0), (5, 0), (0, -1), (0, 3)])
def test_out_of_range_slices_are_refused(block, layer):
    with pytest.raises(ValueError, match="outside the pool"):
        slice_crc32c(_pool(), block, layer)
    with pytest.raises(ValueError, match="outside the pool"):
        slices_crc32c(_pool(), [0, block], [0, layer])


def test_non_contiguous_or_flat_pools_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        pool_bytes(_pool().transpose(0, 1))
    with pytest.raises(ValueError, match="num_blocks, num_layers"):
        pool_bytes(torch.zeros(8))
