"""A server freezes what start-up left: later full collections no longer walk it, and the
garbage start-up made is collected first, not frozen with the rest."""

from __future__ import annotations

import gc
import weakref

from pdserve.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_startup_objects_are_frozen_and_startup_garbage_is_collected() -> None:
    kept = [Node() for _ in range(1000)]
    dropped = Node()
    gone = weakref.ref(dropped)
    del dropped
    try:
        freeze_startup_heap()
        assert gone() is None
        assert gc.get_freeze_count() >= len(kept)
        assert not any(obj is kept[0] for obj in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
