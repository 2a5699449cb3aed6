"""One leg from the router's side: POST it to a worker, read its NDJSON token events.

The events come in batches: every complete line that one read of the connection found, so a
router that is behind relays several events at the cost of one (never waiting for more).

Bounded: connecting takes at most `connect_s`, and a leg that stays silent for `idle_s` fails
(the worker's own transfer leases are shorter, so a healthy worker always speaks first).
Closing the iterator early (the client went away, or the other leg finished the request)
closes the connection, and the worker cancels the leg. After the final event the end of the
response is read (it follows at once), so the connection goes back to the pool for the next
leg instead of being closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp

from pdserve.api.legs import EventBatch, LegRequest, TokenEvent
from pdserve.router.worker_pool import WorkerHandle

END_WAIT_S = 1.0  # longest wait for a response's end after its final event


class LegFailed(Exception):
    """A leg ended without its final event. `status` is the worker's HTTP status when it
    refused the leg (4xx: the request is at fault, retrying elsewhere will not help)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def client_error(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


async def stream_leg(session: aiohttp.ClientSession, worker: WorkerHandle, leg: LegRequest,
                     connect_s: float, idle_s: float) -> AsyncIterator[EventBatch]:
    """The leg's events, in batches; the last batch ends with the final event."""
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_s, sock_connect=connect_s,
                                    sock_read=idle_s)
    worker.inflight += 1
    try:
        async with session.post(f"{worker.url}/internal/legs", json=leg.to_json(),
                                timeout=timeout) as resp:
            if resp.status != 200:
                raise LegFailed(await _error_message(resp), resp.status)
            rest = b""
            async for data in resp.content.iter_any():
                *lines, rest = (rest + data).split(b"\n")
                batch = parse_events(lines)
                if not batch:
                    continue
                if not batch[-1].final:
                    yield batch
                    continue
                try:
                    yield batch
                finally:  # also when the caller stops here, as it does after the final event
                    await _read_end(resp)
                return
        raise LegFailed(f"{worker.name} closed the {leg.kind.value} leg before its end")
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        kind = "timed out" if isinstance(e, TimeoutError) else f"failed: {e!r}"
        raise LegFailed(f"{leg.kind.value} leg on {worker.name} {kind}") from e
    finally:
        worker.inflight -= 1


def parse_events(lines: list[bytes]) -> EventBatch:
    """The events of complete NDJSON lines, up to the first final one."""
    batch = []
    for line in lines:
        batch.append(TokenEvent.from_line(line))
        if batch[-1].final:
            break
    return batch


async def _read_end(resp: aiohttp.ClientResponse) -> None:
    """Read what follows the final event: only the end of the chunked body."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with asyncio.timeout(END_WAIT_S):
            await resp.content.read()


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    try:
        body = await resp.json()
        return str(body["error"]["message"])
    except (aiohttp.ClientError, ValueError, KeyError, TypeError):
        return f"HTTP {resp.status}"
