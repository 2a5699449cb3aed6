"""`python -m pdserve.engine.kernels`: build this environment's CPU operators now, ahead of their
first use (`make test` runs it beside its first tests, which wait for it where they use them).

Exit status 0 whether they built or not: where they cannot build, the reason is logged and the
models run on PyTorch operators.
"""

from __future__ import annotations

import logging
import sys

from pdserve.engine import kernels


def main() -> int:
    logging.basicConfig(format="%(message)s")
    ops = kernels.cpu_ops()
    where = kernels.build_dir() if ops is not None else "unavailable (see above)"
    print(f"pdserve's CPU operators: {where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
