"""How a write or a read's answer is cut into WRITE / READ_DATA frames of at most about
`budget` bytes each.

A frame carries whole (block, layer) slices: several blocks with every layer of the move when
one block's span fits the budget, else one block with as many layers as fit (at least one).
The frames cover the slices once each, in block-major order (a reader relies on it). Smaller
frames let control messages through sooner (`send_queue.py`) at the cost of one 32-byte
header per frame (and one WRITE_DONE per WRITE frame); budget 0 sends the whole move as one
frame.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    blocks: slice  # indexes into the move's block lists
    first: int  # layers [first, end) of each of those blocks
    end: int


def plan(num_blocks: int, first: int, end: int, layer_nbytes: int, budget: int) -> list[Chunk]:
    """Frames covering blocks [0, num_blocks) x layers [first, end), in order."""
    span = (end - first) * layer_nbytes
    if budget <= 0 or num_blocks * span <= budget:
        return [Chunk(slice(0, num_blocks), first, end)]
    if span <= budget:
        per = budget // span
        return [Chunk(slice(b, min(b + per, num_blocks)), first, end)
                for b in range(0, num_blocks, per)]
    layers = max(1, budget // layer_nbytes)
    return [Chunk(slice(b, b + 1), lo, min(lo + layers, end))
            for b in range(num_blocks) for lo in range(first, end, layers)]
