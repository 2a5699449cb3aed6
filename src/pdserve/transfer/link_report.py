"""What an endpoint knows of its link to each peer, from the KV it really moved: bandwidth and
round-trip time. A worker reports them in its signed /health as `links`.

Sources, by transport:
- tcp (`source` "tcp_info"): the kernel's own estimates for the connection this endpoint
  dialed to the peer (TCP_INFO): the delivery rate of the latest round trips (the BBR paper's
  delivery rate, Cardwell et al. 2016; `app_limited` when the sender had too little to send
  for it to fill the link, so then it understates the link), the smoothed and the minimum
  round-trip time, and the bytes the peer acknowledged. The kernel updates them with every
  acknowledgement: they follow the link as it changes. Between transfers the kernel's current
  sample is app-limited (the tail of the last transfer, a control message): the rate is then
  the last one read after a bulk frame while the sender was not app-limited (`FramePace`),
  and `app_limited` is true only while no such sample exists.
- nixl (`source` "transfers"): bytes over seconds of the moves this endpoint posted to the
  peer, from posting to NIXL's DONE, each move weighing half as much every `HALF_LIFE_S`
  (`TransferRates`); NIXL reports no round-trip time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

HALF_LIFE_S = 10.0  # a move's weight in a NIXL link's rate halves after this long


@dataclass(frozen=True)
class LinkReport:
    peer: str  # the peer's KV endpoint, host:port
    source: str  # "tcp_info" or "transfers" (see the module docstring)
    gbps: float | None  # None: nothing measured yet
    bytes_sent: int  # KV and messages this endpoint sent the peer
    rtt_ms: float | None = None  # smoothed; None where the transport does not know
    min_rtt_ms: float | None = None
    app_limited: bool = False  # tcp: the rate sample was limited by the sender, not the link

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TransferRates:
    """Per peer: a decaying bytes / seconds of completed moves. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # peer -> (weighted bytes, weighted seconds, total bytes, when the weights were set)
        self._links: dict[str, tuple[float, float, int, float]] = {}

    def record(self, peer: str, nbytes: int, seconds: float) -> None:
        """One completed move of `nbytes` that took `seconds` (posting to done)."""
        if nbytes <= 0 or not seconds > 0:
            return
        with self._lock:
            wb, ws, total, _ = self._decayed(peer)
            self._links[peer] = (wb + nbytes, ws + seconds, total + nbytes, self._clock())

    def reports(self) -> list[LinkReport]:
        with self._lock:
            rows = [(peer, *self._decayed(peer)) for peer in self._links]
        return [LinkReport(peer, "transfers", wb * 8 / ws / 1e9 if ws > 0 else None, total)
                for peer, wb, ws, total, _ in sorted(rows)]

    def _decayed(self, peer: str) -> tuple[float, float, int, float]:
        wb, ws, total, at = self._links.get(peer, (0.0, 0.0, 0, self._clock()))
        now = self._clock()
        factor = math.pow(0.5, (now - at) / HALF_LIFE_S)
        return wb * factor, ws * factor, total, now
