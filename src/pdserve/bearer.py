"""Bearer keys: `Authorization: Bearer <key>` for endpoints a deployment keeps to its own tools
(a worker's or the router's `/metrics` under `--metrics-key-file`).

A key file holds one key a line (blank lines and lines starting with `#` are skipped), so a key
can be rotated by listing the old and the new one for a while. Keys are compared in constant
time, each against every key, so the time taken says nothing about which key came close.
Torch-free: the router imports it too.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection
from pathlib import Path

MIN_KEY_CHARS = 16
_SCHEME = "bearer"


def read_key_file(path: Path | str, flag: str, min_chars: int = MIN_KEY_CHARS) -> tuple[str, ...]:
    """The keys in `path`; ValueError naming `flag` and the file when it cannot be read, holds
    no key, or holds one shorter than `min_chars` (a short key can be guessed) or with spaces
    (a header could not carry it)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {flag} {path}: {e}") from e
    keys = tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{flag} {path} holds no key (one key a line)")
    for n, key in enumerate(keys, 1):
        if len(key) < min_chars or any(c.isspace() for c in key):
            raise ValueError(f"{flag} {path}: key {n} must be at least {min_chars} characters "
                             "without spaces (e.g. python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))')")
    return keys


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None for any other header."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == _SCHEME and token else None


def bearer_matches(authorization: str | None, keys: Collection[str]) -> bool:
    """Whether the header carries one of `keys` (constant time per key, every key tried)."""
    token = bearer_token(authorization)
    if token is None:
        return False
    given = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found
