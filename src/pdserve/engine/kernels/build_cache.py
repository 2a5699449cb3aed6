"""Builds published whole: a cache folder either holds a finished build or does not exist.

A build runs in a temporary sibling `.<name>.partial-<pid>` and is renamed into place when it
has finished, so no process ever loads a half-written library. Builders of one folder take an
exclusive lock (`<name>.lock`, fcntl.flock, beside the folder) for the whole build: processes
that start together build once, the others wait and then find the finished folder. The kernel
drops a lock with its holder, so a partial folder found while holding the lock belongs to a
build that was killed half-way: it is removed then, never read.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PARTIAL = ".partial-"


def is_built(folder: Path) -> bool:
    """Whether `folder` holds a finished build (folders appear only finished)."""
    return folder.is_dir()


def build_once(folder: Path, compile_into: Callable[[Path], T]) -> T | None:
    """Make `folder` a finished build unless it is one: `compile_into(tmp)` fills an empty
    temporary sibling, which is then renamed to `folder`.

    Returns what `compile_into` returned when this call built the folder; None when it was
    already built, perhaps by another process while this one waited for the lock. Raises what
    `compile_into` raises, after removing its temporary folder.
    """
    if is_built(folder):
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.parent / f"{folder.name}.lock"):
        if is_built(folder):
            return None
        remove_partial_builds(folder)
        tmp = folder.parent / f".{folder.name}{PARTIAL}{os.getpid()}"
        tmp.mkdir()
        try:
            result = compile_into(tmp)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return result


def remove_partial_builds(folder: Path) -> None:
    """Remove the temporary folders of builds of `folder`; only while holding its lock."""
    for partial in folder.parent.glob(f".{folder.name}{PARTIAL}*"):
        shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_file` (created if missing); waits for other holders."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock
