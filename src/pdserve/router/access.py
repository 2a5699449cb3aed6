"""Who may call the router: API keys and a rate limit on `/v1/*`, a key on `/metrics`.

One aiohttp middleware does both checks before the handler reads the body, so a refused
request costs a header lookup, a SHA-256 of its key and a dict update. A request's identity
is its key when the router has keys, else its client address (`request.remote`: behind a
proxy every client shares the proxy's bucket). `/health` is public (its per-worker details
need the cluster secret: `app.py`). Refusals are OpenAI-shaped, so `openai` clients raise
`AuthenticationError` (401) and `RateLimitError` (429, after honouring `Retry-After`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from pdserve.api.errors import INVALID_REQUEST, ApiError
from pdserve.bearer import KeySet, bearer_token, check_key, read_key_file
from pdserve.router.rate_limit import RateLimit, TokenBuckets, retry_after

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
API_PREFIX = "/v1/"
METRICS_REFUSAL = ApiError(401, "/metrics needs `Authorization: Bearer <key>` with the key of "
                                "--metrics-key-file", code="invalid_api_key")


@dataclass(frozen=True)
class AccessSettings:
    api_keys: KeySet | None = None  # None: /v1/* is open
    metrics_keys: KeySet | None = None  # None: /metrics is open
    rate_limit: RateLimit | None = None  # None: no limit

    @property
    def guarded(self) -> bool:
        return any(x is not None for x in (self.api_keys, self.metrics_keys, self.rate_limit))


def access_middleware(access: AccessSettings,
                      refused: Callable[[int], None] = lambda status: None,
                      clock: Callable[[], float] = time.monotonic
                      ) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware enforcing `access`, calling `refused(status)` for each request it
    refuses on /v1/* (the router counts them); its buckets live as long as it does."""
    keys, metrics_keys, limit = access.api_keys, access.metrics_keys, access.rate_limit
    buckets = TokenBuckets(limit, clock) if limit is not None else None

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith(API_PREFIX):
            identity: object = request.remote
            if keys is not None:
                authorization = request.headers.get("Authorization")
                identity = keys.identity(authorization)
                if identity is None:
                    refused(401)
                    return _unauthorized(api_key_refusal(authorization))
            if buckets is not None:
                wait = buckets.take(identity)
                if wait > 0:
                    refused(429)
                    return rate_limited(wait, limit, by_key=keys is not None)
        elif (path == "/metrics" and metrics_keys is not None
              and metrics_keys.identity(request.headers.get("Authorization")) is None):
            return _unauthorized(METRICS_REFUSAL)
        return await handler(request)

    return guard


def api_key_refusal(authorization: str | None) -> ApiError:
    if not authorization:
        message = ("You didn't provide an API key. You need to provide your API key in an "
                   "Authorization header using Bearer auth (i.e. Authorization: Bearer "
                   "YOUR_KEY).")
    else:
        message = f"Incorrect API key provided: {redacted(authorization)}."
    return ApiError(401, message, type=INVALID_REQUEST, code="invalid_api_key")


def rate_limited(wait_s: float, limit: RateLimit, by_key: bool) -> web.Response:
    seconds = retry_after(wait_s)
    per = "API key" if by_key else "client address"
    error = ApiError(429, f"Rate limit reached for requests: {limit.rate:g} per second (burst "
                          f"{limit.burst}) per {per}. Please try again in {seconds}s.",
                     type="requests", code="rate_limit_exceeded")
    return web.json_response(error.body(), status=429,
                             headers={"Retry-After": str(seconds)})


def redacted(authorization: str | None) -> str:
    """What a refusal may say about the key it got: OpenAI's shape (its first 3 and last 4
    characters) for a long printable key, never the whole key."""
    key = bearer_token(authorization) or ""
    if len(key) < 12 or not (key.isascii() and key.isprintable()):
        return "****"
    return f"{key[:3]}{'*' * min(len(key) - 7, 16)}{key[-4:]}"


def _unauthorized(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=401, headers={"WWW-Authenticate": "Bearer"})


def add_access_args(p: argparse.ArgumentParser) -> None:
    """The router's options: a key on the command line, the shared ones, the metrics key."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' on /v1/* "
                        "(repeat for several; at least 16 characters). Visible to other local "
                        "users in the process list: prefer --api-keys-file. With no key given, "
                        "/v1/* is open")
    add_client_access_args(p)
    p.add_argument("--metrics-key-file", type=Path, default=None, metavar="FILE",
                   help="file with the key(s), one a line, that /metrics then requires as "
                        "'Authorization: Bearer <key>' (default: /metrics is open)")


def add_client_access_args(p: argparse.ArgumentParser) -> None:
    """What clients of /v1 need and may do: `pdserve router`'s and `pdserve up`'s options."""
    p.add_argument("--api-keys-file", type=Path, default=None, metavar="FILE",
                   help="file of accepted API keys, one a line ('#' starts a comment; at least "
                        "16 characters each), that clients send as 'Authorization: Bearer "
                        "<key>' on /v1/*, else 401: list an old and a new key together to "
                        "rotate (default: /v1/* is open)")
    p.add_argument("--rate-limit", type=float, default=None, metavar="R",
                   help="requests per second each API key (each client address when there are "
                        "no keys) may send to /v1/*, as a token bucket; beyond it 429 with "
                        "Retry-After (default: no limit)")
    p.add_argument("--rate-burst", type=int, default=None, metavar="B",
                   help="requests a key may send at once after a quiet spell (the bucket's "
                        "size; default: R rounded up, at least 1)")


def rate_limit_from_args(args: argparse.Namespace) -> RateLimit | None:
    """ValueError for a bad limit, or a burst without a limit."""
    if args.rate_burst is not None and args.rate_limit is None:
        raise ValueError("--rate-burst sizes the bucket of --rate-limit: give --rate-limit too")
    return None if args.rate_limit is None else RateLimit.of(args.rate_limit, args.rate_burst)


def access_from_args(args: argparse.Namespace) -> AccessSettings:
    """ValueError for a bad key, an unreadable or empty key file, or a bad limit."""
    keys = [check_key(k, "--api-key: a key") for k in args.api_key]
    if args.api_keys_file is not None:
        keys += read_key_file(args.api_keys_file, "--api-keys-file")
    metrics = None if args.metrics_key_file is None else \
        KeySet(read_key_file(args.metrics_key_file, "--metrics-key-file"))
    return AccessSettings(KeySet(keys) if keys else None, metrics, rate_limit_from_args(args))
