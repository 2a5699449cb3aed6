"""What a local process without the cluster secret can do to a running `pdserve up`: it can
reach every port, but it cannot open legs on a worker, get a worker to dial it, or make the
workers give up on each other; another user's greedy output stays what it was."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time

import aiohttp

from pdserve.internal_auth import InternalAuth
from pdserve.transfer.auth import sign
from pdserve.transfer.tcp.frames import Frame, header
from tests.serve.cluster import Cluster, metric
from tests.serve.test_faults import DECODE, LONG, PREFILL
from tests.serve.test_serving import client

FLOOD = 100  # connections per KV port: over the per-endpoint cap


async def _upgrade_status(url: str, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(url, headers=headers):
                return 101
        except aiohttp.WSServerHandshakeError as e:
            return e.status


def _greedy(cluster: Cluster) -> tuple[str, int]:
    out = client(cluster).completions.create(model=cluster.model, prompt=LONG, max_tokens=48,
                                             temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text, out.usage.completion_tokens


def _flood(host: str, port: int) -> list[socket.socket]:
    """FLOOD connections: a third silent, a third sending junk, a third a HELLO signed with
    another secret."""
    envelope = sign(os.urandom(32), json.dumps({"kind": "hello"}).encode())
    forged = header(Frame.HELLO, plen=len(envelope)) + envelope
    socks = []
    for i in range(FLOOD):
        try:
            s = socket.create_connection((host, port), timeout=1)
        except OSError:
            continue  # refused at accept: the cap at work
        socks.append(s)
        payload = b"" if i % 3 == 0 else os.urandom(64) if i % 3 == 1 else forged
        with contextlib.suppress(OSError):
            s.sendall(payload)
    return socks


def test_strangers_neither_open_legs_nor_disturb_transfers(disagg_tcp: Cluster) -> None:
    reference = _greedy(disagg_tcp)
    workers = [disagg_tcp.worker_url(i) for i in (PREFILL, DECODE)]
    recomputes = metric(workers[1], "pdserve_kv_recomputes_total")
    stranger = InternalAuth(os.urandom(32))
    for url in workers:
        for headers in ({}, stranger.headers("GET", "/internal/legs"),
                        {"X-Pdserve-Auth": "00" * 80}):
            status = asyncio.run(_upgrade_status(url + "/internal/legs", headers))
            assert status == 401, (url, headers, status)
    peers = [disagg_tcp.health(i)["peer"] for i in (PREFILL, DECODE)]
    socks: list[socket.socket] = []
    try:
        for peer in peers:
            socks += _flood(peer["host"], peer["port"])
        during = _greedy(disagg_tcp)  # while the strangers hold their connections
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    after = _greedy(disagg_tcp)
    assert during == reference and after == reference
    assert metric(workers[1], "pdserve_kv_recomputes_total") == recomputes, \
        "a stranger made the workers give up on each other"
    disagg_tcp.wait_blocks_free([PREFILL, DECODE])
    assert [disagg_tcp.health(i)["peer"] for i in (PREFILL, DECODE)] == peers  # no restart
