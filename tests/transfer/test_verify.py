"""Receiver-side admission check on a real KVCache and BlockManager."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.model_config import ModelConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.request import Request
from pdserve.transfer.checksum import slices_crc32c
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import CompletionNotice, TransferDescriptor
from pdserve.transfer.peer import PeerId
from pdserve.transfer.state import TransferState, TransferStatus
from pdserve.transfer.verify import VerifyReport, verify_transfer

MODEL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=128)
BS, NUM_BLOCKS, PROMPT = 4, 12, list(range(10))  # 10 tokens: 3 blocks
PREFILL = PeerId(0x1111, "10.0.0.1", 7100)
DECODE = PeerId(0x2222, "10.0.0.2", 7200)


@dataclasses.dataclass
class Handover:
    """One prefill-to-decode transfer as the transfer plane will run it, minus the transport."""

    src: KVCache
    dst: KVCache
    bm: BlockManager
    req: Request
    descriptor: TransferDescriptor
    notice: CompletionNotice

    def verify(self, notice: CompletionNotice | None = None, **desc) -> VerifyReport:
        d = dataclasses.replace(self.descriptor, **desc) if desc else self.descriptor
        return verify_transfer(self.dst, d, notice or self.notice, self.bm.generation)


def _handover(dtype: torch.dtype = torch.bfloat16, layers: range = range(3),
              seed: int = 0) -> Handover:
    src = KVCache(MODEL, NUM_BLOCKS, BS, dtype)
    src.data.copy_(torch.randn(src.data.shape, generator=torch.Generator().manual_seed(seed)))
    dst = KVCache(MODEL, NUM_BLOCKS, BS, dtype)
    bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    bm.allocate(Request("warm", [1] * 8, 8, SamplingParams()))  # dst ids differ from src ids
    req = Request("r", list(PROMPT), len(PROMPT), SamplingParams())
    bm.allocate(req)  # the decode reservation
    src_ids = [7, 2, 9]
    d = TransferDescriptor(
        transfer_id=0xABCDEF, sender=PREFILL, receiver=DECODE, src_block_ids=tuple(src_ids),
        dst_block_ids=tuple(req.block_ids),
        dst_generations=tuple(bm.generation(b) for b in req.block_ids),
        layer_begin=layers.start, layer_end=layers.stop,
        layout=KVLayout.of_cache(dst, "tiny"),
    )
    dst.copy_blocks_from(src, src_ids, req.block_ids)  # the "transport"
    checksums = tuple(slices_crc32c(src.data, src_ids, layers))
    notice = CompletionNotice(d.transfer_id, PREFILL, checksums, token0=5, token0_logprob=-0.1)
    return Handover(src, dst, bm, req, d, notice)


def _flip(cache: KVCache, block: int, layer: int, offset: int = 0, bit: int = 0) -> None:
    cache.data[block, layer].view(torch.uint8).view(-1)[offset] ^= 1 << bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_faithful_transfer_verifies(dtype):
    h = _handover(dtype)
    report = h.verify()
    assert report.ok and report.reason == "" and report.transfer_id == 0xABCDEF
    assert h.verify(None, checksums=h.notice.checksums).ok  # pull: checksums in the descriptor


def test_every_flipped_slice_is_detected():
    h = _handover()
    for block in h.req.block_ids:
        for layer in range(3):
            _flip(h.dst, block, layer)
            report = h.verify()
            assert report.corrupt_slices == ((block, layer),) and not report.stale_blocks
            assert not report.ok and "CRC32C" in report.reason
            _flip(h.dst, block, layer)  # undo
    assert h.verify().ok


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_flipped_bit_is_detected(data):
    h = _handover()
    nbytes = h.dst.data[0, 0].numel() * h.dst.data.element_size()
    flips = data.draw(st.lists(st.tuples(st.sampled_from(h.req.block_ids), st.integers(0, 2),
                                         st.integers(0, nbytes - 1), st.integers(0, 7)),
                               min_size=1, max_size=4, unique_by=lambda f: f[:2]))
    for block, layer, offset, bit in flips:
        _flip(h.dst, block, layer, offset, bit)
    assert sorted(h.verify().corrupt_slices) == sorted((b, layer) for b, layer, _, _ in flips)


def test_bytes_outside_the_transfer_do_not_matter():
    h = _handover(layers=range(1, 3))
    outsider = next(b for b in range(NUM_BLOCKS) if b not in h.req.block_ids)
    _flip(h.dst, outsider, 1)
    _flip(h.dst, h.req.block_ids[0], 0)  # layer 0 is not part of this transfer
    assert h.verify().ok
    _flip(h.dst, h.req.block_ids[0], 1)
    assert h.verify().corrupt_slices == ((h.req.block_ids[0], 1),)


def test_a_reallocated_block_is_stale():
    """The reservation was aborted and its blocks given to another request: a late notice
    must not admit bytes that now belong to someone else."""
    h = _handover()
    h.bm.free(h.req)
    other = Request("other", [3] * 5, 5, SamplingParams())
    h.bm.allocate(other)  # takes the freed blocks back, bumping their generations
    reused = set(other.block_ids) & set(h.descriptor.dst_block_ids)
    assert reused
    report = h.verify()
    assert set(report.stale_blocks) == reused and not report.ok
    assert "generation changed" in report.reason
    assert not {b for b, _ in report.corrupt_slices} & reused  # stale blocks are not summed


def test_a_restarted_sender_is_not_trusted():
    h = _handover()
    restarted = PeerId(0x3333, PREFILL.host, PREFILL.port)  # same address, new instance
    report = h.verify(dataclasses.replace(h.notice, sender=restarted))
    assert not report.ok and "restarted or foreign peer" in report.reason


@pytest.mark.parametrize(
    ("notice_crc", "desc_crc", "problem"),
    [((), (), "no checksums"), ((1, 2), (), "carries 2 checksums for 9"),
     ("flip", "same", "disagree")],
)
def test_missing_or_inconsistent_checksums(notice_crc, desc_crc, problem):
    h = _handover()
    good = h.notice.checksums
    if notice_crc == "flip":
        notice_crc, desc_crc = (good[0] ^ 1, *good[1:]), good
    report = h.verify(dataclasses.replace(h.notice, checksums=notice_crc), checksums=desc_crc)
    assert not report.ok and problem in report.reason and report.problems


def test_no_notice_and_no_checksums_is_a_problem():
    h = _handover()
    assert "no checksums" in verify_transfer(h.dst, h.descriptor, None, h.bm.generation).reason


def test_inputs_that_cannot_belong_together_raise():
    h = _handover()
    with pytest.raises(ValueError, match="paired with"):
        h.verify(dataclasses.replace(h.notice, transfer_id=1))
    other_pool = KVCache(MODEL, NUM_BLOCKS, BS, torch.float16)
    with pytest.raises(ValueError, match="check_compatible"):
        verify_transfer(other_pool, h.descriptor, h.notice, h.bm.generation)
    with pytest.raises(ValueError, match="names destination block 40"):
        h.verify(dst_block_ids=(0, 1, 40))


def test_a_failed_report_fails_the_transfer():
    h = _handover()
    status = TransferStatus(TransferState.TRANSFERRING)
    _flip(h.dst, h.req.block_ids[2], 2)
    report = h.verify()
    assert status.fail(report.reason) and status.state is TransferState.FAILED
    assert str(h.req.block_ids[2]) in (status.reason or "")
