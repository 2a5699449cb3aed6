"""Drives a worker's `TransferHub` from a thread of its own.

Why: sessions advance only when polled (the reservation turns into a write, a finished write
into its checksums and completion notice, a notice into the ACK). Polled from the engine
thread, a transfer would wait for the end of whatever step is running, and a prefill worker
in a multi-second prefill would hold every finished prompt's KV back for that long (measured:
token 1 arrived 4.8 s after token 0 in a burst). Here a thread polls every `interval_s` while
transfers are open (`idle_s` otherwise, for stray messages), and queues the events for the
engine thread, which alone touches the engine.

Invariant: every hub call happens under one lock, so the hub still sees one caller at a time.
Lifetime: `start()` after the pool is registered; `stop()` before the transport closes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from pdserve.transfer.descriptors import PeerId
from pdserve.workers.transfer_hub import HubEvent, TransferHub


class HubPump:
    def __init__(self, hub: TransferHub, interval_s: float = 0.0005,
                 idle_s: float = 0.005) -> None:
        self._hub = hub
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[HubEvent] = queue.SimpleQueue()
        self._interval_s, self._idle_s = interval_s, idle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transfer-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for event in self._hub.poll():
                    self._events.put(event)
                active = self._hub.active
            self._stop.wait(self._interval_s if active else self._idle_s)

    def take_events(self) -> list[HubEvent]:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    # -- the hub's calls, one at a time -------------------------------------------------------

    @property
    def active(self) -> int:
        with self._lock:
            return self._hub.active

    @property
    def local(self) -> PeerId:
        return self._hub.local

    def expect(self, transfer_id: int) -> None:
        with self._lock:
            self._hub.expect(transfer_id)

    def stream_layers(self, transfer_id: int, peer: PeerId, src_blocks: Sequence[int],
                      num_layers: int) -> None:
        with self._lock:
            self._hub.stream_layers(transfer_id, peer, src_blocks, num_layers)

    def open_send(self, transfer_id: int, peer: PeerId, src_blocks: Sequence[int], token0: int,
                  logprob: float | None) -> bool:
        with self._lock:
            return self._hub.open_send(transfer_id, peer, src_blocks, token0, logprob)

    def open_recv(self, transfer_id: int, peer: PeerId, dst_blocks: Sequence[int]) -> None:
        with self._lock:
            self._hub.open_recv(transfer_id, peer, dst_blocks)

    def abort(self, transfer_id: int, reason: str) -> None:
        with self._lock:
            self._hub.abort(transfer_id, reason)

    def close(self, transfer_id: int, peer: PeerId | None, reason: str) -> None:
        with self._lock:
            self._hub.close(transfer_id, peer, reason)

    def close_finished(self, transfer_id: int, peer: PeerId) -> None:
        with self._lock:
            self._hub.close_finished(transfer_id, peer)
