"""Logging of the server processes (worker, router): the thread that logs formats the line and
appends it to a buffer; a writer thread writes the buffer to stderr in batches.

Why off the logging thread: under `pdserve up` a child's stderr is a pipe that the parent
relays, and a write to it can block. The router logs one line per request from its event loop;
at 64 streams that write was 20% of the router's samples (py-spy, 159 of 799), time in which no
token was relayed.

Why in batches: waking a writer thread per line (a `QueueHandler`) cost the event loop a
context switch per line on the router's core: cProfile put 0.2 s of the router's 0.9 s in
`SimpleQueue.put_nowait` over 512 requests at 64 streams. The first line after the writer went
quiet wakes it; it waits `FLUSH_S` for the lines that follow and writes them all at once: one
wake per window instead of one per line. A warning or worse cuts the window short: it is
written at once.

Lifetime: `setup` replaces the root logger's handlers once per process; the writer writes what
is left at exit (`atexit`), so lines logged before a normal exit are not lost. A line reaches
stderr at most `FLUSH_S` after it is logged.
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
from typing import TextIO

FLUSH_S = 0.05


class BatchWriter(logging.Handler):
    """Lines buffered where they are logged, written by one thread, a window at a time."""

    def __init__(self, stream: TextIO, flush_s: float = FLUSH_S) -> None:
        super().__init__()
        self.stream, self.flush_s = stream, flush_s
        self._lines: collections.deque[str] = collections.deque()
        self._wake, self._now, self._closing = (threading.Event(), threading.Event(),
                                                threading.Event())
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:  # called with self.lock held
        try:
            self._lines.append(self.format(record) + "\n")
        except Exception:
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING:
            self._now.set()
            self._wake.set()
        elif len(self._lines) == 1:  # the writer is asleep or about to take the buffer
            self._wake.set()

    def _run(self) -> None:
        while not self._closing.is_set():
            self._wake.wait()
            self._now.wait(self.flush_s)  # the window, cut short by a warning or by close
            self._wake.clear()
            self._now.clear()
            self._write()

    def _write(self) -> None:
        with self.lock:
            lines = "".join(self._lines)
            self._lines.clear()
        if lines:
            try:
                self.stream.write(lines)
                self.stream.flush()
            except (OSError, ValueError):  # stderr closed: nowhere left to say it
                pass

    def close(self) -> None:
        self._closing.set()
        self._now.set()
        self._wake.set()
        self._thread.join(timeout=1.0)
        self._write()
        super().close()


def setup(name: str, level: int = logging.INFO) -> None:
    """Every record of this process, formatted with `name`, written to stderr off the thread
    that logs it."""
    writer = BatchWriter(sys.stderr)
    writer.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.setLevel(level)
    root.handlers[:] = [writer]
    atexit.register(writer.close)
