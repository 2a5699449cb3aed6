"""The per-run cluster secret, handed to the router and every worker as the path of a private
file.

Lifetime: `write_secret` creates a fresh directory (mode 0700) holding one file (mode 0600,
64 hex characters, no newline); `remove_secret` deletes both once every process is stopped.
A file the user gives (`pdserve up --secret-file`) is theirs: it is read and checked before
anything starts, and never removed. The secret itself never appears on a command line or in
the environment.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

SECRET_NAME = "cluster-secret"


def write_secret() -> Path:
    """A new random secret (secrets.token_hex(32)) in a new private file; returns its path."""
    folder = Path(tempfile.mkdtemp(prefix="pdserve-up-"))  # mkdtemp makes it 0700
    path = folder / SECRET_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def remove_secret(path: Path) -> None:
    """Delete the file and its directory; nothing happens for parts already gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()
