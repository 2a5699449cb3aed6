"""The TCP transport: `TcpTransport` and its `TcpOptions` (parts listed in `transport.py`)."""

from pdserve.transfer.tcp.options import TcpOptions
from pdserve.transfer.tcp.transport import TcpTransport

__all__ = ["TcpOptions", "TcpTransport"]
