"""`pdserve ctl`'s calls to the router: signed with the cluster secret, answered with proof.

Each call is one signed request (`internal_auth.py`) to the router's `/internal/workers`
endpoints (`router/admin.py`); a 2xx answer counts only with the router's proof that it holds
the same secret, so a process that merely answers on the router's port (another cluster's
router, an orphan) is never taken for it. Failures are `CtlError`s that say what to check:
the router unreachable (the URL), refused (the secret, the request), or its error message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth

# Straight to the router, never through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class CtlError(Exception):
    """A failed call, in words for the operator (the command exits 1); `status` is the
    router's HTTP status when it answered with an error, else None."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RouterClient:
    url: str  # the router's base URL
    auth: InternalAuth
    timeout_s: float = 10.0

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON of the router's proved 2xx answer to a signed `method` `path`."""
        headers = self.auth.headers(method, path)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method=method)
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as resp:
                raw, proof = resp.read(), resp.headers.get(PROOF_HEADER)
        except urllib.error.HTTPError as e:
            raise CtlError(_refusal(e.code, e.read()), e.code) from None
        except (urllib.error.URLError, HTTPException, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise CtlError(f"cannot reach the router at {self.url}: {reason}") from None
        if not self.auth.check_proof(headers[AUTH_HEADER], raw, proof):
            raise CtlError(f"{self.url} answered without proof of the cluster secret: it is "
                           "not a router of the cluster whose --secret-file was given")
        try:
            return json.loads(raw)
        except ValueError:
            raise CtlError(f"{self.url} answered {method} {path} with no JSON") from None


def _refusal(status: int, raw: bytes) -> str:
    """The router's error message for `status`, with a hint where one helps."""
    try:
        message = str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace").strip()[:300] or "no message"
        if status == 404:
            message += " (is the URL a pdserve router?)"
    if status == 401:
        message += " (is --secret-file the cluster's secret?)"
    return f"the router answered {status}: {message}"
