"""The TCP transport's handshake messages, each bound to the one channel it was made for.

HELLO and HELLO_ACK carry the JSON body of a `Greeting` inside a signed `HandshakeAuth`
envelope (`auth.py`: the MAC proves the shared secret, the time and nonce freshness and
single use):

    HELLO      {"kind": "hello", "peer": the dialer, "to": the PeerId it means to reach
                (instance id included), "cipher"}
    HELLO_ACK  {"kind": "ack", "peer": the acceptor, "to": the dialer, "hello": SHA-256 (hex)
                of the HELLO envelope it answers, "cipher"}

What binds what. `kind` keeps the two apart: an ACK is never taken for a HELLO, nor a HELLO
for an ACK. A HELLO's `to` names one endpoint; an acceptor that is not exactly it refuses, so
a HELLO relayed from another address (a party that got a worker to dial it, then forwarded
the signed HELLO) names the relay's address and opens nothing. An ACK's `to` and `hello` bind
it to one dialer and the one HELLO it answers, so it is useless anywhere else. Both envelopes
feed the sealed connection's key (`HandshakeAuth.session_key`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp.frames import ProtocolError

CIPHERS = ("none", "aes-256-gcm")
GreetingKind = Literal["hello", "ack"]


def digest(envelope: bytes) -> str:
    """What an ACK names of the HELLO envelope it answers."""
    return hashlib.sha256(envelope).hexdigest()


@dataclass(frozen=True)
class Greeting:
    kind: GreetingKind
    peer: PeerId  # the side that sends it
    to: PeerId  # the side it is meant for
    cipher: str
    hello: str = ""  # an ACK's `digest` of the HELLO envelope it answers; "" in a HELLO

    def encode(self) -> bytes:
        body = {"kind": self.kind, "peer": self.peer.to_json(), "to": self.to.to_json(),
                "cipher": self.cipher}
        if self.kind == "ack":
            body["hello"] = self.hello
        return json.dumps(body).encode()

    @classmethod
    def parse(cls, message: bytes, kind: GreetingKind) -> Greeting:
        """The greeting in an authenticated `message`, which must be of `kind`: ProtocolError
        for anything else (another kind, a missing or extra field, an unknown cipher)."""
        keys = {"kind", "peer", "to", "cipher"} | ({"hello"} if kind == "ack" else set())
        try:
            body = json.loads(message)
            if not isinstance(body, dict) or body.get("kind") != kind:
                got = body.get("kind") if isinstance(body, dict) else None
                raise ProtocolError(f"expected a {kind} greeting, got kind {got!r}")
            if set(body) != keys:
                raise ProtocolError(f"a {kind} greeting has the fields {sorted(keys)}, got "
                                    f"{sorted(body)}")
            greeting = cls(kind, PeerId.from_json(body["peer"]), PeerId.from_json(body["to"]),
                           body["cipher"], body.get("hello", ""))
        except ProtocolError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise ProtocolError(f"bad {kind} greeting: {e!r}") from None
        if greeting.cipher not in CIPHERS:
            raise ProtocolError(f"the {kind} names an unknown cipher {greeting.cipher!r}")
        if not isinstance(greeting.hello, str):
            raise ProtocolError(f"the {kind} names its HELLO as {greeting.hello!r}")
        return greeting
