"""Warnings about refused requests, rate-limited: a flood of bad requests must not fill the log
(nor hold the event loop writing it).

Invariant: at most one line per `every_s`; the refusals in between are counted, and the next
line says how many there were. Lifetime: one per server process, used on its event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0


class RefusalLog:
    def __init__(self, log: logging.Logger, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._every_s, self._clock = log, every_s, clock
        self._next = float("-inf")
        self._quiet = 0  # refusals not logged since the last line

    def refused(self, remote: str | None, method: str, path: str, why: str) -> None:
        now = self._clock()
        if now < self._next:
            self._quiet += 1
            return
        more = f" ({self._quiet} more refused since the last such line)" if self._quiet else ""
        self._log.warning("refused %s %s from %s: %s%s", method, path, remote or "?", why, more)
        self._quiet = 0
        self._next = now + self._every_s
