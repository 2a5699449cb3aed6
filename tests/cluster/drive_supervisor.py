"""Drive `run` as `pdserve up` does, over the specs in argv[1] (JSON: [[name, argv, url], ...]):
the first spec is phase one, the rest phase two; prints READY when all are healthy, then serves
until SIGINT/SIGTERM (grace 0.5 s) and reports whether the signal handlers came back."""

from __future__ import annotations

import json
import signal
import sys

from pdserve.cluster.supervisor import ProcessSpec, run


def main(specs_json: str) -> int:
    specs = [ProcessSpec(name, tuple(argv), url) for name, argv, url in json.loads(specs_json)]
    status = run([specs[:1], specs[1:]], 10, grace_s=0.5,
                 on_ready=lambda: print("READY", flush=True), log=sys.stdout)
    restored = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    print("handlers restored" if restored else "handlers NOT restored", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
