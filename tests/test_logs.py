"""Server processes log through a buffer that a writer thread empties: the logging thread never
writes to stderr itself, a line reaches stderr within the flush window, and lines logged just
before exit are written at exit."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, os, sys, threading, time
from pdserve import logs
logs.setup("router:8000")
assert [type(h) for h in logging.getLogger().handlers] == [logs.BatchWriter]
log = logging.getLogger("pdserve.router")
log.info("request %s: done", "cmpl-1")
log.debug("not shown")
writer = [t for t in threading.enumerate() if t is not threading.main_thread()]
assert [t.name for t in writer] == ["log-writer"], writer
if sys.argv[1] == "window":
    time.sleep(10 * logs.FLUSH_S)
    os._exit(0)  # no atexit: only what the writer wrote by itself is there
for i in range(200):
    log.warning("line %d", i)
"""


def run(mode: str) -> list[str]:
    res = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stderr.splitlines()


def test_a_line_reaches_stderr_within_the_flush_window() -> None:
    lines = run("window")
    assert len(lines) == 1 and lines[0].endswith(" router:8000 INFO request cmpl-1: done")


def test_lines_logged_just_before_exit_are_written_in_order() -> None:
    lines = run("exit")
    assert len(lines) == 201
    assert [line.split(" WARNING ")[1] for line in lines[1:]] == [f"line {i}"
                                                                  for i in range(200)]
