"""`pdserve worker --advertise ADDR`: a worker that binds every address (or one others cannot
dial) names ADDR as where to reach it: in its KV endpoint's peer id (what its /health reports
and peers dial, through the signed handshake) and in the URL it registers with a router."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from pdserve.transfer.tcp import TcpTransport
from pdserve.workers.settings import (
    WorkerLaunch,
    add_worker_args,
    join_settings,
    launch_from_args,
    settings_from_args,
    worker_argv,
)

SECRET = b"s" * 32


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return p.parse_args(list(argv))


def _secret(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


def test_advertise_reads_back_from_the_worker_argv() -> None:
    launch = WorkerLaunch(host="0.0.0.0", advertise="10.250.0.11", port=9001)
    argv = worker_argv(launch)
    assert argv[argv.index("--advertise") + 1] == "10.250.0.11"
    assert launch_from_args(_parse(*argv)) == launch


def test_the_kv_endpoint_advertises_the_address_unless_kv_host_names_one(tmp_path) -> None:
    secret = _secret(tmp_path)
    common = ("--role", "prefill", "--secret-file", secret)
    s = settings_from_args(_parse(*common, "--host", "0.0.0.0", "--advertise", "10.250.0.11"))
    assert (s.host, s.kv_host, s.kv_advertise) == ("0.0.0.0", "0.0.0.0", "10.250.0.11")
    own = settings_from_args(_parse(*common, "--host", "0.0.0.0", "--advertise", "10.0.0.1",
                                    "--kv-host", "10.9.0.1"))
    assert (own.kv_host, own.kv_advertise) == ("10.9.0.1", None)
    assert settings_from_args(_parse(*common)).kv_advertise is None


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "10.0.0.1 x"])
def test_an_address_nobody_can_dial_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="--advertise must be the one address others reach"):
        WorkerLaunch(host="0.0.0.0", advertise=address)


def test_a_registering_worker_gives_the_router_its_advertised_url() -> None:
    launch = WorkerLaunch(host="0.0.0.0", port=9002, advertise="10.250.0.12",
                          register="http://10.250.0.10:8000")
    join = join_settings(launch)
    assert join is not None
    assert (join.url, join.name) == ("http://10.250.0.12:9002", "10.250.0.12:9002")
    with pytest.raises(ValueError, match=r"--advertise ADDR"):
        join_settings(WorkerLaunch(host="0.0.0.0", register="http://10.250.0.10:8000"))


def test_a_peer_reaches_a_wildcard_endpoint_at_its_advertised_address() -> None:
    with TcpTransport("0.0.0.0", 0, secret=SECRET, advertise_host="127.0.0.1") as server, \
            TcpTransport("127.0.0.1", 0, secret=SECRET) as client:
        assert server.local.host == "127.0.0.1"
        client.send(server.local, b"over the handshake")
        deadline = time.monotonic() + 5
        got: list = []
        while not got and time.monotonic() < deadline:
            got = server.receive()
            time.sleep(0.01)
        assert got == [(client.local, b"over the handshake")]
