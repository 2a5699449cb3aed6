"""The per-run cluster secret, handed to the router and every worker as the path of a private
file.

Lifetime: `write_secret` creates a fresh directory (mode 0700) holding the secret (mode 0600,
64 hex characters, no newline) and an `owner` file naming the process that made it (its pid
and its start time, so a later process with the same pid is not taken for it); the owner file
is written first, so a directory without one is still being made. `remove_secret` deletes the
directory once every process is stopped. An owner killed before that (SIGKILL, a crash) leaves
it behind: `remove_stale_secrets`, called by the next `pdserve up` before it starts anything,
deletes every such directory of this user whose owner is gone, never one of a live run. A file
the user gives (`pdserve up --secret-file`) is theirs: it is read and checked before anything
starts, and never removed. The secret itself never appears on a command line or in the
environment.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

SECRET_NAME = "cluster-secret"
OWNER_NAME = "owner"
PREFIX = "pdserve-up-"


def write_secret(root: Path | None = None) -> Path:
    """A new random secret (secrets.token_hex(32)) in a new private directory under `root`
    (default: the system's temporary directory), owned by this process; returns its path."""
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))  # mkdtemp makes it 0700
    _write_private(folder / OWNER_NAME, _identity(os.getpid()) or str(os.getpid()))
    path = folder / SECRET_NAME
    _write_private(path, secrets.token_hex(32))
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def remove_secret(path: Path) -> None:
    """Delete the file, its owner file and its directory; parts already gone are skipped."""
    for name in (path, path.with_name(OWNER_NAME)):
        with contextlib.suppress(FileNotFoundError):
            name.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def remove_stale_secrets(root: Path | None = None) -> list[Path]:
    """Delete the secret directories under `root` (default: the temporary directory) that
    belong to this user and whose owner process is gone; returns those deleted."""
    base = Path(root if root is not None else tempfile.gettempdir())
    removed = []
    for folder in sorted(base.glob(PREFIX + "*")):
        if _is_stale(folder):
            remove_secret(folder / SECRET_NAME)
            if not folder.exists():
                removed.append(folder)
    return removed


def _is_stale(folder: Path) -> bool:
    try:
        info = folder.lstat()
        if not folder.is_dir() or folder.is_symlink() or info.st_uid != os.getuid():
            return False
        owner = (folder / OWNER_NAME).read_text().strip()
    except OSError:  # not ours, or its owner file is not written yet
        return False
    pid_text = owner.split()[0] if owner else ""
    if not pid_text.isdigit():
        return False
    if _identity(os.getpid()) is None:  # no /proc here: the pid alone
        return not _alive(int(pid_text))
    return _identity(int(pid_text)) != owner


def _identity(pid: int) -> str | None:
    """'PID START' (start: clock ticks after boot, from /proc), or None without /proc or
    when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return f"{pid} {fields[19]}"


def _alive(pid: int) -> bool:
    """Without /proc: whether a process `pid` exists (it may be another one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
