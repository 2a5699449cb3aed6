"""A loopback relay for the bound-handshake tests: the address a lured worker dials.

Usage: python relay.py TARGET_PORT LIFETIME_S [--inject BLOCK --tid T --layers N --layer-bytes B]

Accepts on 127.0.0.1 (a free port, printed as the first line of stdout) and pipes each
connection to 127.0.0.1:TARGET_PORT, both ways; exits after LIFETIME_S seconds whatever is
open. With --inject it plays the attacker of a relayed handshake: it forwards the dialer's
first frame (its signed HELLO), reads the target's answer, then sends the target a WRITE of
its own on that connection (transfer T, block BLOCK, every one of N layers, bytes 0xAB), as
if it were the dialer, before it forwards the answer and goes on piping.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import threading
import time

from pdserve.transfer.tcp.frames import HEADER, Frame, header, recv_exact, u32s

MAX_GREETING = 1 << 16


def read_frame(sock: socket.socket) -> bytes:
    """One whole frame (header and payload), or b"" when the peer closed first."""
    try:
        head = recv_exact(sock, HEADER.size)
        plen = HEADER.unpack(head)[4]
        return head + recv_exact(sock, min(plen, MAX_GREETING))
    except OSError:
        return b""


def pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def serve(client: socket.socket, target: int, injected: bytes | None) -> None:
    with client, socket.create_connection(("127.0.0.1", target)) as upstream:
        if injected is not None:
            upstream.sendall(read_frame(client))
            answer = read_frame(upstream)
            with contextlib.suppress(OSError):
                upstream.sendall(injected)
                client.sendall(answer)
        back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
        back.start()
        pipe(client, upstream)
        back.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", type=int)
    ap.add_argument("lifetime_s", type=float)
    ap.add_argument("--inject", type=int)
    ap.add_argument("--tid", type=int, default=1)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--layer-bytes", type=int, default=1)
    args = ap.parse_args()
    injected = None
    if args.inject is not None:
        body = u32s([0, args.layers, args.inject]) + b"\xab" * (args.layers * args.layer_bytes)
        injected = header(Frame.WRITE, 1, args.tid, 1, len(body)) + body
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    print(server.getsockname()[1], flush=True)
    deadline = time.monotonic() + args.lifetime_s
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            client, _ = server.accept()
            client.settimeout(args.lifetime_s)
            threading.Thread(target=serve, args=(client, args.target, injected),
                             daemon=True).start()
    os._exit(0)  # bounded: whatever is still piping ends with the process


if __name__ == "__main__":
    main()
