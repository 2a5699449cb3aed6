"""Polls a worker's `TransferHub` from a thread of its own and queues its events.

Why: sessions advance only when polled (the reservation turns into a write, a finished write
into its checksums and completion notice, a notice into the ACK). Polled from the engine
thread, a transfer would wait for the end of whatever step is running, and a prefill worker
in a multi-second prefill would hold every finished prompt's KV back for that long (measured:
token 1 arrived 4.8 s after token 0 in a burst). Here a thread polls every `interval_s` while
transfers are open (`idle_s` otherwise, for stray messages), and queues the events for the
engine thread, which alone touches the engine. The engine thread calls the hub directly (the
hub takes its own lock) and takes the events with `take_events`.

Lifetime: `start()` after the pool is registered; `stop()` before the transport closes.
"""

from __future__ import annotations

import queue
import threading

from pdserve.workers.transfer_hub import HubEvent, TransferHub


class HubPump:
    def __init__(self, hub: TransferHub, interval_s: float = 0.0005,
                 idle_s: float = 0.005) -> None:
        self.hub = hub
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
            for event in self.hub.poll():
                self._events.put(event)
            self._stop.wait(self._interval_s if self.hub.active else self._idle_s)

    def take_events(self) -> list[HubEvent]:
        """Every event polled since the previous call, in the order the hub reported them."""
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events
