"""Logging of the server processes (worker, router): the thread that logs only queues the
record; one background thread writes it to stderr.

Why: under `pdserve up` a child's stderr is a pipe that the parent relays, and a write to it
can block. The router logs one line per request from its event loop; at 64 streams that write
was 20% of the router's samples (py-spy, 159 of 799), time in which no token was relayed.

Lifetime: `setup` replaces the root logger's handlers once per process; the writer thread
drains the queue at exit (`atexit`), so lines logged before a normal exit are not lost.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys


def setup(name: str, level: int = logging.INFO) -> None:
    """Every record of this process, formatted with `name`, written to stderr off the thread
    that logs it."""
    records: queue.SimpleQueue = queue.SimpleQueue()
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
    listener = logging.handlers.QueueListener(records, writer)
    root = logging.getLogger()
    root.setLevel(level)
    root.handlers[:] = [logging.handlers.QueueHandler(records)]
    listener.start()
    atexit.register(listener.stop)
