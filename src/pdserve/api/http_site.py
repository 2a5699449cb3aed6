"""Starting and stopping one of pdserve's HTTP servers (a worker or the router).

Handlers are cancelled when their client disconnects (`handler_cancellation`): that is how a
client that goes away cancels its legs. SIGTERM and SIGINT set the returned event; the caller
then cleans up (`runner.cleanup()` cancels the handlers still running).
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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
