"""Both sides of the TCP transport's bound handshake (messages in `hello.py`).

Dialer (`dial`): sends a signed HELLO addressed to the exact peer it means to reach, then
waits for the HELLO_ACK as long as the peer's host is up (a stall is not a death); the ACK
must be signed, of kind "ack", addressed to this endpoint, name the digest of this HELLO and
come from that address. Acceptor (`accept`): the HELLO must be complete within
`handshake_timeout_s` of the accept, signed, fresh and unreplayed (`HandshakeAuth`), of kind
"hello" and addressed to exactly `local`; it then answers a HELLO_ACK bound to that HELLO.
Only then is a connection authenticated: a refused or failed handshake changes no state and
marks nobody dead (the acceptor logs a rate-limited warning naming the remote address). The
one exception is the peer bookkeeping of a bound, authenticated greeting (`seen`): it may
reveal that an older instance at the greeter's address restarted.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.auth import HandshakeAuth, PeerRefused
from pdserve.transfer.peer import PeerId, restarted
from pdserve.transfer.tcp.frames import (
    HEADER,
    MAX_SMALL_BYTES,
    Frame,
    HandshakeCut,
    PeerReplaced,
    ProtocolError,
    header,
    parse_header,
    recv_exact,
    settimeout_by,
    shut,
)
from pdserve.transfer.tcp.hello import Greeting, GreetingKind, digest
from pdserve.transfer.tcp.wire import Wire

if TYPE_CHECKING:
    from pdserve.transfer.tcp.options import TcpOptions

log = logging.getLogger(__name__)


class BoundHandshake:
    """One endpoint's handshakes. `seen(peer)` is the peer table's bookkeeping of a peer that
    proved itself with a bound greeting (it raises PeerRefused for an instance known dead).
    Thread-safe (the signer's nonce memory is behind a lock). Lifetime: the endpoint's."""

    def __init__(self, auth: HandshakeAuth, local: PeerId, options: TcpOptions,
                 seen: Callable[[PeerId], None], throttled: ThrottledLog) -> None:
        self._auth, self._local, self.options = auth, local, options
        self._seen, self._throttled = seen, throttled
        self._lock = threading.Lock()

    def dial(self, sock: socket.socket, peer: PeerId) -> Wire:
        """HELLO addressed to `peer`, then wait for the HELLO_ACK bound to it for as long as
        the peer's host is up (see `TcpOptions`); a different instance answering means `peer`
        restarted (PeerReplaced). HandshakeCut when the connection closes before any
        HELLO_ACK. The socket is shut on any failure."""
        try:
            frame = self._greeting(Frame.HELLO, peer)
            hello = frame[HEADER.size:]
            try:
                sock.sendall(frame)
                self._warn_if_silent(sock, peer)
                ack, envelope = self._read_greeting(sock, Frame.HELLO_ACK, None)
            except (OSError, EOFError) as e:
                raise HandshakeCut(f"{peer.host}:{peer.port} closed the connection before "
                                   f"answering the handshake: {e}") from None
            if ack.to != self._local or ack.hello != digest(hello):
                raise ProtocolError(f"{peer.host}:{peer.port} sent a HELLO_ACK that answers "
                                    "another handshake")
            if not ack.peer.same_address(peer):
                raise ProtocolError(f"{peer.host}:{peer.port} answered as {ack.peer}")
            self._seen(ack.peer)
            if ack.peer != peer:
                raise PeerReplaced(restarted(ack.peer))
            if (refused := self._cipher_mismatch(ack.peer, ack.cipher)) is not None:
                raise refused
            return self._wire(sock, hello, envelope)
        except BaseException:
            shut(sock)
            raise

    def accept(self, conn: socket.socket, addr: tuple[str, int],
               deadline: float) -> tuple[PeerId, Wire] | None:
        """Verify the dialer's HELLO and answer its HELLO_ACK, all by `deadline`
        (time.monotonic()); None (logged, rate-limited) when refused, with no state changed.
        A peer with another cipher still gets the ACK, so that both sides can say why they
        refuse."""
        try:
            hello, envelope = self._read_greeting(conn, Frame.HELLO, deadline)
            if hello.to != self._local:
                self._misaddressed(conn, hello, envelope, deadline)
            self._seen(hello.peer)
            ack = self._greeting(Frame.HELLO_ACK, hello.peer, envelope)
            self._send_by(conn, ack, deadline)
            if (refused := self._cipher_mismatch(hello.peer, hello.cipher)) is not None:
                raise refused
        except (PeerRefused, ProtocolError, OSError, EOFError) as e:
            why = f"the handshake was not complete within {self.options.handshake_timeout_s} s " \
                f"of the accept ({e})" if isinstance(e, TimeoutError) else str(e)
            self._throttled.warn("handshake", "refused connection from %s:%s: %s", addr[0],
                                 addr[1], why)
            return None
        conn.settimeout(None)
        return hello.peer, self._wire(conn, envelope, ack[HEADER.size:])

    # -- the parts -----------------------------------------------------------------------------

    def _greeting(self, ftype: Frame, to: PeerId, hello: bytes = b"") -> bytes:
        """A signed HELLO to `to`, or (given the HELLO envelope it answers) a HELLO_ACK, as
        one frame."""
        kind: GreetingKind = "hello" if ftype is Frame.HELLO else "ack"
        body = Greeting(kind, self._local, to, self.options.cipher, digest(hello) if hello
                        else "").encode()
        with self._lock:
            envelope = self._auth.sign(body)
        return header(ftype, plen=len(envelope)) + envelope

    def _read_greeting(self, sock: socket.socket, expect: Frame,
                       deadline: float | None) -> tuple[Greeting, bytes]:
        """The authenticated greeting (HELLO or HELLO_ACK) and its envelope; all of it by
        `deadline` when given."""
        ftype, _, _, _, plen = parse_header(recv_exact(sock, HEADER.size, deadline))
        if ftype is not expect or plen > MAX_SMALL_BYTES:
            raise ProtocolError(f"expected {expect.name}, got {ftype.name} of {plen} bytes")
        envelope = recv_exact(sock, plen, deadline)
        with self._lock:
            message = self._auth.verify(envelope)
        return Greeting.parse(message, "hello" if expect is Frame.HELLO else "ack"), envelope

    def _misaddressed(self, conn: socket.socket, hello: Greeting, envelope: bytes,
                      deadline: float) -> None:
        """Refuse a HELLO not addressed to `local`. One for another instance at this address
        first gets our HELLO_ACK, so its dialer learns of the restart."""
        if not hello.to.same_address(self._local):
            raise PeerRefused(f"the HELLO from {hello.peer} is addressed to {hello.to}, not to "
                              f"this endpoint {self._local} (relayed from another address?)")
        self._send_by(conn, self._greeting(Frame.HELLO_ACK, hello.peer, envelope), deadline)
        raise PeerRefused(f"the HELLO from {hello.peer} is addressed to instance "
                          f"{hello.to.instance_id:016x}; this is {self._local.instance_id:016x}"
                          " (answered, so the dialer learns of the restart)")

    @staticmethod
    def _send_by(conn: socket.socket, data: bytes, deadline: float) -> None:
        settimeout_by(conn, deadline)
        conn.sendall(data)

    def _warn_if_silent(self, sock: socket.socket, peer: PeerId) -> None:
        """Warn if the peer has not begun its answer within `handshake_timeout_s` (a peeked
        byte, nothing consumed); the caller then reads it without a bound (see `TcpOptions`)."""
        sock.settimeout(self.options.handshake_timeout_s)
        try:
            sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            log.warning("peer %s accepted the connection but has not answered the handshake in "
                        "%.1f s: stalled, not dead; messages to it wait", peer,
                        self.options.handshake_timeout_s)
        finally:
            sock.settimeout(None)

    def _cipher_mismatch(self, peer: PeerId, cipher: str) -> PeerRefused | None:
        if cipher == self.options.cipher:
            return None
        return PeerRefused(f"{peer} uses KV cipher {cipher!r} but this endpoint uses "
                           f"{self.options.cipher!r}; give every worker the same encryption "
                           "setting")

    def _wire(self, sock: socket.socket, hello: bytes, ack: bytes) -> Wire:
        """The connection's frame I/O; sealed with a key from both envelopes if encrypting."""
        with self._lock:
            key = self._auth.session_key(hello, ack) if self.options.encrypt else None
        return Wire(sock, key)
