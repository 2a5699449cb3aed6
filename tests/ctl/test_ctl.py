"""`pdserve ctl` as an operator runs it: a real subprocess against a real router (served here,
its workers fake HTTP servers): the pool as a table and as JSON, a flip, and every failure a
clear message with a non-zero exit."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp

from pdserve.cluster.up_process import free_port
from tests.router.fake_worker import SECRET, worker_info
from tests.router.test_registry_admin import FlippingWorker, call, card, router, workers
from tests.test_torch_free import REPORT, _assert_torch_free, _run


async def ctl(secret: Path, url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "ctl", "--url", url, "--secret-file", str(secret),
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


def _secret(tmp_path: Path, value: bytes = SECRET) -> Path:
    path = tmp_path / f"secret-{len(list(tmp_path.iterdir()))}"
    path.write_bytes(value + b"\n")
    return path


def test_workers_as_a_table_and_as_json_then_a_flip(tiny_model: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    fakes = [FlippingWorker(worker_info(cpus=[0, 2, 3])), FlippingWorker(worker_info("collocated"))]

    async def go() -> None:
        async with workers(*fakes) as urls, router(tiny_model(), decode=(urls[0],)) as (r, base), \
                aiohttp.ClientSession() as session:
            static = r.pool.workers[0].key
            await call(session, base, "POST", "/internal/workers",
                       card("joined-1", urls[1], "collocated"))
            code, out, err = await ctl(secret, base, "workers")
            assert code == 0, err
            lines = out.splitlines()
            assert lines[0].split() == ["NAME", "ROLE", "STATE", "QUEUE", "LEGS", "KV",
                                        "BLOCKS", "CPUS", "URL", "NOTE"]
            assert lines[1].split() == [static, "decode", "healthy", "0", "0", "0/64", "0,2-3",
                                        urls[0], "static"]
            assert lines[2].split() == ["joined-1", "collocated", "healthy", "0", "0", "0/64",
                                        "-", urls[1]]
            code, out, err = await ctl(secret, base + "/", "workers", "--json")
            assert code == 0, err
            listed = json.loads(out)
            assert [(w["name"], w["url"], w["role"], w["state"], w["queue"],
                     w["kv_blocks_used"], w["kv_blocks_total"]) for w in listed] == [
                (static, urls[0], "decode", "healthy", 0, 0, 64),
                ("joined-1", urls[1], "collocated", "healthy", 0, 0, 64)]
            code, out, err = await ctl(secret, base, "flip", "joined-1", "--role", "prefill",
                                       "--json")
            assert code == 0, err
            result = json.loads(out)
            assert (result["worker"], result["from"], result["to"]) == ("joined-1",
                                                                        "collocated", "prefill")
            assert isinstance(result["seconds"], float)
            code, out, err = await ctl(secret, base, "flip", static, "--role", "collocated")
            assert code == 0, err
            assert out.startswith(f"worker {static}: decode -> collocated in ")
            assert [w.role for w in r.pool.workers] == ["collocated", "prefill"]

    asyncio.run(go())


def test_failures_say_what_to_fix_and_exit_non_zero(tiny_model: Callable[..., Path],
                                                     tmp_path: Path) -> None:
    secret, other = _secret(tmp_path), _secret(tmp_path, b"o" * 32)
    short = _secret(tmp_path, b"short")

    async def go() -> None:
        async with router(tiny_model()) as (_, base):
            code, _, err = await ctl(other, base, "workers")
            assert code == 1
            assert err.startswith("pdserve ctl: error: the router answered 401: ")
            assert "is --secret-file the cluster's secret?" in err
            code, _, err = await ctl(secret, base, "flip", "w9", "--role", "decode")
            assert code == 1 and err.strip() == (
                "pdserve ctl: error: the router answered 404: no worker named 'w9' in the pool")
            closed = f"http://127.0.0.1:{free_port()}"
            code, _, err = await ctl(secret, closed, "workers")
            assert code == 1
            assert err.startswith(f"pdserve ctl: error: cannot reach the router at {closed}: ")
            code, _, err = await ctl(short, base, "workers")
            assert code == 2 and f"--secret-file {short}:" in err and "16 bytes" in err
            code, _, err = await ctl(tmp_path / "missing", base, "workers")
            assert code == 2 and "cannot read --secret-file" in err
            code, _, err = await ctl(secret, "127.0.0.1:8000", "workers")
            assert code == 2 and "--url must be http://HOST:PORT" in err
            code, _, err = await ctl(secret, base, "flip", "a/b", "--role", "decode")
            assert code == 2 and "a worker name is" in err
            assert "Traceback" not in err

    asyncio.run(go())


def test_ctl_is_torch_free() -> None:
    _assert_torch_free(_run(f"import sys\nimport pdserve.ctl.cli\n{REPORT}"))
