"""What the router remembers of each worker's prefix cache: the block hashes it sent there."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

PREFIX_INDEX_BLOCKS = 65_536  # block hashes remembered per worker (LRU)


class PrefixIndex:
    """Block hashes recently routed to one worker, least recently used evicted first."""

    def __init__(self, capacity: int = PREFIX_INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def match(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt this worker has seen (chained hashes: the
        first miss ends the shared prefix)."""
        n = 0
        for h in block_hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, block_hashes: Sequence[int]) -> None:
        """Remember a prompt's blocks; past the capacity only its first blocks (a prefix that
        can still match)."""
        for h in block_hashes[: self.capacity]:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
