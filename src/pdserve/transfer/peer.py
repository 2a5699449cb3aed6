"""Who takes part in a transfer: `PeerId`, one process lifetime of a worker.

A restart at the same address is a new instance with a new random id, so a message from an
older instance is never mistaken for one from the current one (`sessions.Link` judges by it,
the TCP handshake binds it).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

from pdserve.transfer.wire import U64, exact_keys, hex64, parse_hex64, require_int, require_str

_instance: tuple[int, int] | None = None  # (pid, instance id)


def process_instance_id() -> int:
    """This process's random 64-bit instance id: drawn at first use, drawn anew in a forked
    child (a child is another instance even though it inherits the parent's memory)."""
    global _instance
    if _instance is None or _instance[0] != os.getpid():
        _instance = (os.getpid(), secrets.randbelow(U64 - 1) + 1)
    return _instance[1]


@dataclass(frozen=True)
class PeerId:
    """One process lifetime of a worker: a restart at the same address is a new instance.

    `instance_id` is random, 64-bit and non-zero, drawn once per process start
    (`process_instance_id`); a message from another instance than the one a transfer was set up
    with is never trusted.
    """

    instance_id: int
    host: str
    port: int

    def __post_init__(self) -> None:
        require_int("PeerId.instance_id", self.instance_id, 1, U64)
        require_str("PeerId.host", self.host)
        if any(c.isspace() for c in self.host):
            raise ValueError(f"PeerId.host must not contain whitespace, got {self.host!r}")
        require_int("PeerId.port", self.port, 1, 65536)

    @classmethod
    def local(cls, host: str, port: int) -> PeerId:
        """This process, reachable at host:port."""
        return cls(process_instance_id(), host, port)

    def same_address(self, other: PeerId) -> bool:
        """Same host and port; with another instance id that is a restarted, stale peer."""
        return (self.host, self.port) == (other.host, other.port)

    def to_json(self) -> dict[str, Any]:
        return {"instance_id": hex64(self.instance_id), "host": self.host, "port": self.port}

    @classmethod
    def from_json(cls, obj: object) -> PeerId:
        d = exact_keys("peer", obj, ["instance_id", "host", "port"])
        return cls(parse_hex64("peer.instance_id", d["instance_id"]), d["host"], d["port"])


def restarted(new: PeerId) -> str:
    """Why the instance before `new` at its address is dead, in every transport's words."""
    return f"restarted: instance {new.instance_id:016x} now answers at {new.host}:{new.port}"
