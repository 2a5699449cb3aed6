"""Starting and stopping one of pdserve's HTTP servers (a worker or the router).

HTTP plumbing, kept in `api/` because the one thing it configures, the header deadline, comes
from the OpenAI routes' `RequestLimits` (`limits.py`); the router and the workers both start
their servers here, and both may import `api`.

Handlers are cancelled when their client disconnects (`handler_cancellation`): that is how a
client that goes away cancels its legs. SIGTERM and SIGINT set the returned event; the caller
then cleans up (`runner.cleanup()` cancels the handlers still running).

Header deadline: aiohttp has no timeout of its own for a request's headers, but its keep-alive
timer runs from a connection's opening and from the end of each response, and closes the
connection if no complete request has arrived by then (partial headers do not count). So
`keepalive_timeout = RequestLimits.header_timeout_s` is the header deadline: a connection that
sends half a request is closed within it, as is a connection left idle that long. The limits
are the ones the OpenAI routes put on the app (`REQUEST_LIMITS`), else the defaults. The body
deadline is the handler's (`body.py`).
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from pdserve.api.limits import DEFAULT_LIMITS, RequestLimits

REQUEST_LIMITS = web.AppKey("request_limits", RequestLimits)


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    limits = app.get(REQUEST_LIMITS, DEFAULT_LIMITS)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=limits.header_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def stop_event() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets (call inside the running loop)."""
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, stop.set)
    return stop
