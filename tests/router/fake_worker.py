"""A worker's `/health` as the router sees it, served by a real aiohttp server: liveness for
anyone, the signed details with the proof for a request signed with the worker's secret, 401
for a bad signature (as `workers/access.py` does). `info` and `secret` may change between
health rounds (a restart with other settings)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth, PeerRefused
from tests.http_app import serving

SECRET = b"cluster-secret-0123456789abcdef!"
NAME = "tiny"


def worker_info(role: str = "decode", **changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "status": "ok", "role": role, "model": NAME, "max_model_len": 512, "block_size": 16,
        "dtype": "float32", "peer": None, "kv_blocks_total": 64, "kv_blocks_used": 0,
        "running": 0, "waiting": 0, "waiting_for_kv": 0, "legs": 0, "pid": 4242,
        "kv_layout": {"model_id": NAME, "dtype": "float32", "block_size": 16,
                      "num_layers": 2, "kv_heads": 2, "head_dim": 16, "layout": "paged_kv"},
    }
    d.update(changes)
    return d


class FakeWorker:
    def __init__(self, info: dict[str, Any], secret: bytes | None = SECRET,
                 prove: bool = True) -> None:
        self.info, self.secret, self.prove = info, secret, prove
        self.signed_checks = 0

    async def health(self, request: web.Request) -> web.Response:
        header = request.headers.get(AUTH_HEADER)
        if header is None:
            return web.json_response({"status": "ok"})
        auth = InternalAuth(self.secret) if self.secret else None
        if auth is None:
            return web.json_response({"error": {"message": "no secret"}}, status=403)
        try:
            auth.verify(request.method, request.path, header)
        except PeerRefused as e:
            return web.json_response({"error": {"message": str(e)}}, status=401)
        self.signed_checks += 1
        body = json.dumps(self.info).encode()
        headers = {PROOF_HEADER: auth.proof(header, body)} if self.prove else {}
        return web.Response(body=body, content_type="application/json", headers=headers)


@contextlib.asynccontextmanager
async def fake_workers(*workers: FakeWorker) -> AsyncIterator[list[str]]:
    """Each worker served at its own URL; yields the URLs in order."""
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for w in workers:
            app = web.Application()
            app.router.add_get("/health", w.health)
            urls.append(await stack.enter_async_context(serving(app)))
        yield urls
