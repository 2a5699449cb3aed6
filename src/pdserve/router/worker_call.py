"""The router's signed calls that change a worker (`POST /internal/role`, `/internal/cpus`):
signed with the cluster secret for their method and path, and trusted only with the worker's
proof of the same secret on the answer, whatever its status (`internal_auth.py`; a worker
signs its refusals too). An answer without it is no answer: whoever sent it may not speak for
the worker, so the router acts on nothing it says."""

from __future__ import annotations

import aiohttp

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth


class NoAnswer(Exception):
    """The worker gave no answer that proves the secret; the message says why."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


async def post_to_worker(session: aiohttp.ClientSession, auth: InternalAuth, url: str,
                         path: str, body: object, timeout_s: float) -> tuple[int, bytes]:
    """The status and body of the worker's proved answer; NoAnswer otherwise."""
    headers = auth.headers("POST", path)
    try:
        async with session.post(url + path, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status, raw, proof = resp.status, await resp.read(), resp.headers.get(PROOF_HEADER)
    except TimeoutError:
        raise NoAnswer(f"did not answer within {timeout_s:g} s", timed_out=True) from None
    except aiohttp.ClientError as e:
        raise NoAnswer(f"could not be reached: {e}") from None
    if not auth.check_proof(headers[AUTH_HEADER], raw, proof):
        raise NoAnswer(f"answered {status} without proof of the cluster secret")
    return status, raw
