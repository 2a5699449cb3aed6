"""CRC32C of a GPU pool's slices computed on the GPU (`device_crc32c`): the same sums as the
host's CRC32C of the same bytes. Without a GPU the kernel runs in Triton's interpreter over a
CPU tensor (the conftest sets TRITON_INTERPRET where no GPU is seen)."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.transfer import device_crc32c
from pdserve.transfer.checksum import slices_crc32c

pytest.importorskip("triton", reason="the kernel is written in Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter


@pytest.mark.parametrize(("dtype", "shape"), [
    (torch.bfloat16, (7, 3, 2, 16, 3, 64)),  # SmolLM2's slice: 12 KiB
    (torch.float32, (5, 2, 2, 4, 1, 5)),  # 160 bytes: a tile longer than the slice
    (torch.bfloat16, (4, 2, 1, 16, 1, 34)),  # a latent pool's slice, 1,088 bytes
])
def test_sums_on_the_device_are_the_host_sums_of_the_same_bytes(dtype, shape) -> None:
    torch.manual_seed(0)
    pool = torch.randn(*shape).to(dtype)
    blocks, layers = [6 % shape[0], 0, 3], list(range(shape[1]))[::-1]
    want = slices_crc32c(pool, blocks, layers)  # the host's, through fastcrc
    assert device_crc32c.slices_crc32c(pool.to(DEVICE), blocks, layers) == want


def test_one_flipped_bit_changes_its_slice_sum_only() -> None:
    pool = torch.zeros(3, 2, 64, dtype=torch.int32)
    before = device_crc32c.slices_crc32c(pool.to(DEVICE), [0, 1, 2], [0, 1])
    pool[1, 0, 17] ^= 1 << 30
    after = device_crc32c.slices_crc32c(pool.to(DEVICE), [0, 1, 2], [0, 1])
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [2]
    assert after == slices_crc32c(pool, [0, 1, 2], [0, 1])


def test_slices_of_bytes_not_in_whole_words_are_refused() -> None:
    pool = torch.zeros(2, 2, 6, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slices of 6 bytes"):
        device_crc32c.slices_crc32c(pool.to(DEVICE), [0], [1])


def test_a_kernel_with_other_sums_is_not_used(monkeypatch, caplog) -> None:
    device_crc32c.usable.cache_clear()
    try:
        assert device_crc32c.usable(DEVICE)
        device_crc32c.usable.cache_clear()
        monkeypatch.setattr(device_crc32c, "slices_crc32c",
                            lambda pool, blocks, layers: [0] * len(blocks) * len(layers))
        # at this logger itself: a bench run in this process may have quietened pdserve.transfer
        with caplog.at_level(logging.WARNING, logger=device_crc32c.log.name):
            assert not device_crc32c.usable(DEVICE)
        assert "gives other sums than the host's" in caplog.text
    finally:
        device_crc32c.usable.cache_clear()
