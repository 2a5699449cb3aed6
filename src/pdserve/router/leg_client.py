"""One leg from the router's side: POST it to a worker, read its NDJSON token events.

Bounded: connecting takes at most `connect_s`, and a leg that stays silent for `idle_s` fails
(the worker's own transfer leases are shorter, so a healthy worker always speaks first).
Closing the iterator early (the client went away, or the other leg finished the request)
closes the connection, and the worker cancels the leg.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from pdserve.api.legs import LegRequest, TokenEvent
from pdserve.router.worker_pool import WorkerHandle


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
                     connect_s: float, idle_s: float) -> AsyncIterator[TokenEvent]:
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_s, sock_connect=connect_s,
                                    sock_read=idle_s)
    worker.inflight += 1
    try:
        async with session.post(f"{worker.url}/internal/legs", json=leg.to_json(),
                                timeout=timeout) as resp:
            if resp.status != 200:
                raise LegFailed(await _error_message(resp), resp.status)
            async for line in resp.content:
                event = TokenEvent.from_line(line)
                yield event
                if event.final:
                    return
        raise LegFailed(f"{worker.name} closed the {leg.kind.value} leg before its end")
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        kind = "timed out" if isinstance(e, TimeoutError) else f"failed: {e!r}"
        raise LegFailed(f"{leg.kind.value} leg on {worker.name} {kind}") from e
    finally:
        worker.inflight -= 1


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    try:
        body = await resp.json()
        return str(body["error"]["message"])
    except (aiohttp.ClientError, ValueError, KeyError, TypeError):
        return f"HTTP {resp.status}"
