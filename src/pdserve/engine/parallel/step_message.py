"""A step's model inputs as rank 0 sends them to the other ranks.

Plain arrays and ints (pickled by value over the rank's pipe), rebuilt into tensors on the
receiving rank's device: the same input ids, positions and attention metadata rank 0 runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.model.attention import AttentionMetadata, DecodeGroup, PrefillSeq


@dataclass(frozen=True)
class StepMessage:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_blocks: np.ndarray  # [T]
    slot_offsets: np.ndarray  # [T]
    prefills: list[tuple[int, int, int, np.ndarray]]  # PrefillSeq fields
    decode_groups: list[tuple[int, np.ndarray, np.ndarray, int]]  # DecodeGroup fields


def to_message(input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> StepMessage:
    return StepMessage(
        _np(input_ids), _np(positions), _np(meta.slot_blocks), _np(meta.slot_offsets),
        [(p.token_start, p.num_tokens, p.context_len, _np(p.block_ids)) for p in meta.prefills],
        [(g.start, _np(g.blocks), _np(g.lens), g.block_size) for g in meta.decode_groups])


def from_message(msg: StepMessage, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    meta = AttentionMetadata(
        slot_blocks=t(msg.slot_blocks), slot_offsets=t(msg.slot_offsets),
        prefills=[PrefillSeq(start, n, ctx, t(blocks)) for start, n, ctx, blocks in msg.prefills],
        decode_groups=[DecodeGroup(start, t(blocks), t(lens), bs)
                       for start, blocks, lens, bs in msg.decode_groups])
    return t(msg.input_ids), t(msg.positions), meta


def _np(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()
