"""Server processes log through a queue: the logging thread never writes to stderr itself."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, logging.handlers, sys, threading
from pdserve import logs
logs.setup("router:8000")
assert [type(h) for h in logging.getLogger().handlers] == [logging.handlers.QueueHandler]
logging.getLogger("pdserve.router").info("request %s: done", "cmpl-1")
logging.getLogger("pdserve.router").debug("not shown")
writer = [t for t in threading.enumerate() if t is not threading.main_thread()]
assert len(writer) == 1, writer
"""


def test_lines_reach_stderr_from_the_writer_thread_before_exit():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith(" router:8000 INFO request cmpl-1: done")
