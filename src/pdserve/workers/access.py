"""Who may use which of a worker's endpoints; checked before any handler runs.

- `/internal/*` (the router's leg channel, the engine steps, the role change, the cores): a
  holder of the cluster secret only, each request signed for its method and path and used once
  (`internal_auth.py`). A leg channel's WebSocket upgrade is refused before it happens. A
  worker without a secret (a collocated one started with `--serve-public`) answers 403.
- `/health`: anyone gets liveness (`{"status": "ok"}` or 503 `loading`). A signed request gets
  the full info (pid, ports, load, KV layout) with `X-Pdserve-Proof`, the worker's proof that
  it holds the secret (`signed_json`); a signature that is present but bad is refused (401).
- `/v1/*`: only with `--serve-public`; else 403 saying the worker serves through the router
  (whose API keys and limits a direct client would bypass).
- `/metrics`: open, or with `--metrics-key-file` only with `Authorization: Bearer <key>`.

Refusals of a signature are logged as warnings with the remote address, rate-limited
(`throttled_log.py`). Lifetime: one `WorkerAccess` per worker; its nonce memory is used on the
event loop only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdserve.api.errors import ApiError
from pdserve.bearer import KeySet
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth, PeerRefused
from pdserve.throttled_log import ThrottledLog

log = logging.getLogger("pdserve.worker")

INTERNAL_PREFIX = "/internal/"
_SIGNED = web.RequestKey("pdserve_signed_header", str)  # the request's verified signature

NOT_PUBLIC = ("this worker serves clients through the router (pdserve router, or pdserve up), "
              "which holds the API keys and limits; to serve clients from this worker "
              "directly, start it with --serve-public")
NO_SECRET = ("this worker has no cluster secret (started without --secret-file), so its "
             "internal endpoints and signed /health are off")
METRICS_KEY = ("/metrics needs 'Authorization: Bearer <key>' with a key of this worker's "
               "--metrics-key-file")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class WorkerAccess:
    def __init__(self, secret: bytes | None, serve_public: bool,
                 metrics_keys: tuple[str, ...] = ()) -> None:
        self.auth = InternalAuth(secret) if secret is not None else None
        self.serve_public = serve_public
        self.metrics_keys = KeySet(metrics_keys) if metrics_keys else None
        self._refusals = ThrottledLog(log)

    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        @web.middleware
        async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
            refusal = self.refusal(request)
            if refusal is not None:
                return _error(refusal)
            return await handler(request)

        return access

    def refusal(self, request: web.Request) -> ApiError | None:
        """Why `request` may not reach its handler, or None (then a signed request is marked
        for `signed`)."""
        path = request.path
        if path.startswith(INTERNAL_PREFIX):
            return self._check_signature(request)
        if path == "/health" and AUTH_HEADER in request.headers:
            return self._check_signature(request)
        if (path == "/v1" or path.startswith("/v1/")) and not self.serve_public:
            return ApiError(403, NOT_PUBLIC, code="worker_not_public")
        if path == "/metrics" and self.metrics_keys is not None and \
                self.metrics_keys.identity(request.headers.get("Authorization")) is None:
            return ApiError(401, METRICS_KEY, code="invalid_api_key")
        return None

    def _check_signature(self, request: web.Request) -> ApiError | None:
        if self.auth is None:
            return ApiError(403, NO_SECRET, code="no_cluster_secret")
        header = request.headers.get(AUTH_HEADER)
        try:
            self.auth.verify(request.method, request.path, header)
        except PeerRefused as e:
            self._refusals.warn("refused", "refused %s %s from %s: %s", request.method,
                                request.path, request.remote or "?", str(e))
            return ApiError(401, str(e), code="invalid_internal_auth")
        request[_SIGNED] = header
        return None

    @staticmethod
    def signed(request: web.Request) -> bool:
        """Whether the request carried a valid signature (checked by the middleware)."""
        return _SIGNED in request

    def signed_json(self, request: web.Request, obj: Any, status: int = 200) -> web.Response:
        """`obj` as JSON with the proof that this worker holds the secret (a signed request)."""
        body = json.dumps(obj).encode()
        assert self.auth is not None and self.signed(request)
        proof = self.auth.proof(request[_SIGNED], body)
        return web.Response(body=body, status=status, content_type="application/json",
                            headers={PROOF_HEADER: proof})


def _error(e: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.code == "invalid_api_key" else None
    return web.json_response(e.body(), status=e.status, headers=headers)
