"""The API keys the router accepts on `/v1/*` (`Authorization: Bearer <key>`).

Only SHA-256 digests of the keys are kept. A presented key is hashed and compared with every
digest in constant time (no early exit), so the time of a refusal says nothing about how much
of a key was right, nor which key came close. Key files and headers are parsed as for every
bearer key (`bearer.py`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from pdserve.bearer import MIN_KEY_CHARS, bearer_token


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_key(key: str, flag: str) -> str:
    """`key` if it is long enough to resist guessing and fits a header, else ValueError."""
    if len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable() or \
            any(c.isspace() for c in key):
        raise ValueError(f"{flag}: a key must be at least {MIN_KEY_CHARS} printable ASCII "
                         "characters without spaces (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))')")
    return key


class KeySet:
    """Accepted keys, as digests. The identity of an accepted key is its digest (what names
    its rate-limit bucket, without holding the key)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(dict.fromkeys(_digest(k) for k in keys))
        if not self._digests:
            raise ValueError("a KeySet needs at least one key")

    def __len__(self) -> int:
        return len(self._digests)

    def identity(self, authorization: str | None) -> bytes | None:
        """The digest of the key in an `Authorization` header value when it is accepted."""
        token = bearer_token(authorization)
        if token is None:
            return None
        presented = _digest(token)
        found = None
        for digest in self._digests:
            if hmac.compare_digest(digest, presented):
                found = digest
        return found

    def __repr__(self) -> str:  # never show the digests
        return f"KeySet({len(self)} keys)"


def redacted(authorization: str | None) -> str:
    """What a refusal may say about the key it got: OpenAI's shape (its first 3 and last 4
    characters) for a long printable key, never the whole key."""
    key = bearer_token(authorization) or ""
    if len(key) < 12 or not (key.isascii() and key.isprintable()):
        return "****"
    return f"{key[:3]}{'*' * min(len(key) - 7, 16)}{key[-4:]}"
