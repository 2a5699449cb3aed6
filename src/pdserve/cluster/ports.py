"""Ports of a `pdserve up` that must be free before anything starts (`layout.planned_ports`).

`check_ports_free` binds and listens on each port for a moment, with SO_REUSEADDR as the
servers do (`socket.create_server`), so a port only in TIME_WAIT from a stopped run passes
and one that something listens on (an earlier run's orphan, another program) fails. A port can
still be taken between this check and the server's bind; the worker then fails to start and
`pdserve up` reports it.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence


def check_ports_free(host: str, ports: Sequence[tuple[int, str]]) -> None:
    """Raise ValueError naming the first port of `ports` that cannot be bound on `host`."""
    for port, purpose in ports:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
            socket.create_server((host, port), family=family).close()
        except OSError as e:
            raise ValueError(
                f"port {port} on {host}, planned for {purpose}, is in use ({e.strerror or e}): "
                "another pdserve up, or something else, is listening there; stop it or use "
                "--port") from None
