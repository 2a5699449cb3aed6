"""`POST /internal/cpus`: change the cores a worker computes on, live (`workers/cpu_pin.py`
applies it). Signed like every `/internal/` path (`workers/access.py`: 401 without a valid
signature).

Body: `{"cpus": [core, ...]}`, no other key. Answers, each with the worker's proof of the
secret, errors OpenAI-shaped:
- 200 `{"cpus", "threads", "seconds"}`: the worker computes on `cpus` with `threads` compute
  threads from its next step on; `seconds` to apply it (after the step under way ended).
- 400: not a JSON object, another key, an empty list, a core the machine lacks or listed twice,
  a set the kernel refuses.
- 409 `tensor_parallel`: a tensor-parallel engine's ranks keep their cores.
"""

from __future__ import annotations

import logging

from aiohttp import web

from pdserve.api.errors import ApiError
from pdserve.workers.access import WorkerAccess
from pdserve.workers.cpu_pin import parse_cpus
from pdserve.workers.engine_loop import EngineLoop
from pdserve.workers.role_endpoint import read_json

log = logging.getLogger("pdserve.worker")


async def change_cpus(request: web.Request, loop: EngineLoop,
                      access: WorkerAccess) -> web.Response:
    """The handler; the access middleware let only signed requests in."""
    try:
        cpus = parse_cpus(await read_json(request))
    except ApiError as e:
        return access.signed_json(request, e.body(), e.status)
    result = await loop.pin(cpus)
    if isinstance(result, ApiError):
        log.warning("cores %s asked by %s refused: %s", list(cpus), request.remote or "?",
                    result.message)
        return access.signed_json(request, result.body(), result.status)
    log.info("computing on cores %s (%d threads) as asked by %s", list(cpus), result.threads,
             request.remote or "?")
    return access.signed_json(request, result.body())
