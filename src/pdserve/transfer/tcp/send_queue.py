"""One connection's send queue: control before bulk, bulk in arrival order.

Jobs are urgent (control messages, answers to a peer's moves, read requests: each a few
hundred bytes) or bulk (a write's WRITE frames, a read's READ_DATA frames). `get` hands out
every queued urgent job before the next bulk one, so a control message waits at most for the
frame already on the wire, never behind queued data; a write or a read's answer goes out a
frame at a time (`chunks.py`) and its next frame is `resume`d at the head of the bulk line, so
transfers to one peer finish in the order they started (the first one done soonest) rather
than all late together.

A fenced write (`MoveTable.cancel`) sends no further frame. Each of a peer's two connections
has a queue of its own (`send_side.py`): the control connection's jobs are all urgent, so
there the order is the order queued; with one connection per peer both kinds share one.

Invariant: at most `limit` jobs queued (a resumed write or read is not counted again).
Thread-safe: any thread puts, the peer's sender thread gets. Lifetime: the `PeerSender`'s.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

Job = tuple[Any, ...]


class SendQueue:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._urgent: deque[Job] = deque()
        self._bulk: deque[Job] = deque()
        self._ready = threading.Condition()
        self._stopped = False

    def put(self, job: Job, urgent: bool) -> bool:
        """Queue `job`; False when the queue is full or stopped."""
        with self._ready:
            if self._stopped or len(self._urgent) + len(self._bulk) >= self._limit:
                return False
            (self._urgent if urgent else self._bulk).append(job)
            self._ready.notify()
            return True

    def resume(self, job: Job) -> None:
        """Put a bulk job that has more frames to send back at the head of the bulk line."""
        with self._ready:
            if not self._stopped:
                self._bulk.appendleft(job)

    def get(self) -> Job | None:
        """The next job, urgent ones first; blocks; None once stopped."""
        with self._ready:
            self._ready.wait_for(lambda: self._stopped or self._urgent or self._bulk)
            if self._stopped:
                return None
            return (self._urgent or self._bulk).popleft()

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
