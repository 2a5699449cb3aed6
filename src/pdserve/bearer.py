"""Bearer keys: `Authorization: Bearer <key>` for what a deployment keeps to its clients or its
own tools (the router's `/v1/*` under `--api-key` / `--api-keys-file`, a worker's or the
router's `/metrics` under `--metrics-key-file`).

A key file holds one key a line (blank lines and lines starting with `#` are skipped), so a key
can be rotated by listing the old and the new one for a while. Every key, from a file or a
flag, is at least `MIN_KEY_CHARS` printable ASCII characters without spaces. A `KeySet` keeps
only SHA-256 digests of its keys; a presented key is hashed and compared with every digest in
constant time (no early exit), so the time of a refusal says nothing about how much of a key
was right, nor which key came close. Torch-free: the router imports it too.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

MIN_KEY_CHARS = 16
_SCHEME = "bearer"


def check_key(key: str, which: str) -> str:
    """`key` if it is long enough to resist guessing and fits a header, else ValueError
    starting with `which` ("--api-key: a key", "FLAG FILE: key 3")."""
    if len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable() or \
            any(c.isspace() for c in key):
        raise ValueError(f"{which} must be at least {MIN_KEY_CHARS} characters of "
                         "printable ASCII without spaces (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))')")
    return key


def read_key_file(path: Path | str, flag: str) -> tuple[str, ...]:
    """The keys in `path`; ValueError naming `flag` and the file when it cannot be read, holds
    no key, or holds one that `check_key` refuses."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {flag} {path}: {e}") from e
    keys = tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{flag} {path} holds no key (one key a line)")
    return tuple(check_key(key, f"{flag} {path}: key {n}") for n, key in enumerate(keys, 1))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None for any other header."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == _SCHEME and token else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


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
