"""How the router picks a worker from a pool: one interface, three policies.

Every policy sees the same candidates (healthy workers of one role) and the prompt's chained
block hashes (`common/block_hash.py`, the engine's own prefix-cache keys), and returns one.
Load is what the router knows first-hand (legs it has in flight on that worker) plus what the
worker last reported (queued prompt tokens, running batch, used KV blocks).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from pdserve.router.worker_pool import WorkerHandle


class PolicyName(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"


class Policy(Protocol):
    def choose(self, candidates: Sequence[WorkerHandle], block_hashes: Sequence[int]
               ) -> WorkerHandle: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[WorkerHandle], block_hashes: Sequence[int]
               ) -> WorkerHandle:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded:
    """Fewest legs in flight from this router, then the worker's own queue and batch."""

    def choose(self, candidates: Sequence[WorkerHandle], block_hashes: Sequence[int]
               ) -> WorkerHandle:
        return min(candidates, key=lambda w: (w.load, w.url))


class PrefixAware:
    """The worker whose cache most likely holds the longest prefix of this prompt (the router
    remembers the block hashes it sent to each worker); ties and misses go to the least loaded.
    A cached block is worth `blocks_per_leg` blocks of load: past that, spreading wins."""

    def __init__(self, blocks_per_leg: int = 8) -> None:
        self.blocks_per_leg = blocks_per_leg
        self._least = LeastLoaded()

    def choose(self, candidates: Sequence[WorkerHandle], block_hashes: Sequence[int]
               ) -> WorkerHandle:
        def score(w: WorkerHandle) -> tuple[float, str]:
            return (w.load - w.prefix.match(block_hashes) / self.blocks_per_leg, w.url)

        if not block_hashes:
            return self._least.choose(candidates, block_hashes)
        return min(candidates, key=score)


def make_policy(name: str) -> Policy:
    try:
        kind = PolicyName(name)
    except ValueError:
        raise ValueError(f"unknown policy {name!r}; use one of "
                         f"{', '.join(p.value for p in PolicyName)}") from None
    return {PolicyName.ROUND_ROBIN: RoundRobin, PolicyName.LEAST_LOADED: LeastLoaded,
            PolicyName.PREFIX: PrefixAware}[kind]()
