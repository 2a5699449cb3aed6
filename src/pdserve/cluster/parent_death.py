"""Children that die with their supervisor: Linux's parent-death signal, set between fork and
exec.

`guard(signum)` returns the `preexec_fn` for `subprocess.Popen`: in the forked child, before
exec, it asks the kernel (`prctl(PR_SET_PDEATHSIG, signum)`) to send `signum` when the parent
dies, then compares `os.getppid()` with the supervisor's pid taken before the fork: when they
differ the parent died before the request took effect, and the child exits at once (status
PARENT_GONE) instead of running on as an orphan. The setting survives exec (not of a set-uid
program) and is not inherited by the child's own children (a worker's strays go with its
process group at `stop`, or run on after a SIGKILL of the supervisor).

Invariant the caller keeps: the kernel ties the signal to the parent *thread* that forked, so
children are launched from a thread that lives as long as the supervisor (its main thread).
Where prctl is missing (not Linux) `guard` returns None: children then outlive a killed
supervisor.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
PARENT_GONE = 125  # exit status of a child whose parent died before prctl took effect


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once here (never between fork and exec), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def available() -> bool:
    """True where children can be told to die with their parent."""
    return _PRCTL is not None


def guard(signum: int = signal.SIGTERM,
          parent: int | None = None) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get `signum` when its parent dies; None where
    unavailable. `parent`: the pid the child must find as its parent (default: this process,
    which then launches the child from the thread that lives as long as it)."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid() if parent is None else parent

    def in_child() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            os._exit(PARENT_GONE)  # cannot promise to die with the parent: do not start
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os._exit(PARENT_GONE)

    return in_child


def current() -> int:
    """The parent-death signal of this process (0: none), for checks in a child."""
    if _PRCTL is None:
        return 0
    value = ctypes.c_int(0)
    _PRCTL(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value
