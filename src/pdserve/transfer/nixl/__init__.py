"""The NIXL transport: `NixlTransport` and its `NixlOptions` (parts listed in `transport.py`).

Importing it needs `nixl_cu12`."""

from pdserve.transfer.nixl.move import NixlOptions
from pdserve.transfer.nixl.transport import NixlTransport, make_agent

__all__ = ["NixlOptions", "NixlTransport", "make_agent"]
