"""Authentication of the cluster's internal HTTP surfaces with the shared cluster secret.

Every internal request (the router's health checks and leg channels to a worker, a tool's
`/internal/steps`) carries one header, `X-Pdserve-Auth`: the hex of a signed envelope
(`transfer/auth.py`: HMAC-SHA256 over a timestamp, a random nonce and the message) whose
message is

    pdserve-internal-http/v1 \\n METHOD \\n PATH

(PATH without the query). The server refuses a missing header, a forged or stale envelope, an
envelope signed for another method or path, and a nonce it accepted before within the window
(a replay): each header is good for one request. The message prefix keeps these envelopes
apart from the KV port's HELLOs, which are JSON.

A server that holds the secret proves it in its answer: `X-Pdserve-Proof` is
HMAC-SHA256(secret, proof domain || request header || body), so a client that checks it knows
the worker shares its secret too (a worker with another secret cannot produce it).

Lifetime: one `InternalAuth` per process; `verify` remembers nonces (not thread-safe: call it
from the event loop only).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pdserve.transfer.auth import HandshakeAuth, PeerRefused

AUTH_HEADER = "X-Pdserve-Auth"
PROOF_HEADER = "X-Pdserve-Proof"
_PREFIX = b"pdserve-internal-http/v1\n"
_PROOF_DOMAIN = b"pdserve/internal-http-proof/v1\x00"


def _message(method: str, path: str) -> bytes:
    return _PREFIX + method.upper().encode() + b"\n" + path.encode()


class InternalAuth:
    """Signs and verifies internal requests, and proves or checks a server's answers."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._auth = HandshakeAuth(secret)  # raises ValueError for a too-short secret

    def headers(self, method: str, path: str) -> dict[str, str]:
        """The header that authenticates one `method` request to `path` (no query)."""
        return {AUTH_HEADER: self._auth.sign(_message(method, path)).hex()}

    def verify(self, method: str, path: str, header: str | None) -> None:
        """Raises PeerRefused unless `header` is a fresh, unreplayed signature of this
        method and path by a holder of the secret."""
        if not header:
            raise PeerRefused(f"no {AUTH_HEADER} header (internal endpoints need the cluster "
                              "secret)")
        try:
            envelope = bytes.fromhex(header)
        except ValueError:
            raise PeerRefused(f"{AUTH_HEADER} is not hex") from None
        message = self._auth.verify(envelope)
        if not hmac.compare_digest(message, _message(method, path)):
            raise PeerRefused(f"{AUTH_HEADER} was signed for another request, not "
                              f"{method.upper()} {path}")

    def proof(self, request_header: str, body: bytes) -> str:
        """The server's proof that it holds the secret, for one answer to one request."""
        h = hmac.new(self._secret, _PROOF_DOMAIN, hashlib.sha256)
        h.update(request_header.encode())
        h.update(body)
        return h.hexdigest()

    def check_proof(self, request_header: str, body: bytes, proof: str | None) -> bool:
        return proof is not None and hmac.compare_digest(proof, self.proof(request_header, body))

    def __repr__(self) -> str:  # never show the secret
        return "InternalAuth()"


def read_secret_file(path: Path | str) -> bytes:
    """The secret in `path` (surrounding whitespace stripped); ValueError naming the file when
    it cannot be read or is too short, so a process refuses before loading a model."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read --secret-file {path}: {e}") from e
    try:
        HandshakeAuth(secret)
    except ValueError as e:
        raise ValueError(f"--secret-file {path}: {e}") from None
    return secret


__all__ = ["AUTH_HEADER", "PROOF_HEADER", "InternalAuth", "PeerRefused", "read_secret_file"]
