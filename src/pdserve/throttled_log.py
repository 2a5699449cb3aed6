"""Rate-limited warnings for what a peer or a stranger can make a process log at will (refused
connections and moves on a KV port, refused requests on an HTTP server): a flood must not fill
the log, nor hold a thread or an event loop writing it.

Invariant: per key, at most one line per `every_s`; the warnings in between are counted, and
the next line of that key says how many there were. Thread-safe. Lifetime: one per endpoint
or server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0


class ThrottledLog:
    def __init__(self, log: logging.Logger, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 level: int = logging.WARNING) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self._log, self._every_s, self._clock, self._level = log, every_s, clock, level
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._quiet: dict[str, int] = {}  # warnings not logged since the key's last line

    def warn(self, key: str, fmt: str, *args: object) -> None:
        """Log `fmt % args` (a warning, or at the `level` given) unless `key` logged within
        `every_s`."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(key, float("-inf")):
                self._quiet[key] = self._quiet.get(key, 0) + 1
                return
            quiet = self._quiet.pop(key, 0)
            self._next[key] = now + self._every_s
        more = f" ({quiet} more like it since the last such line)" if quiet else ""
        self._log.log(self._level, fmt + "%s", *args, more)
