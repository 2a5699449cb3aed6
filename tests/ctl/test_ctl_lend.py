"""`pdserve ctl lend` and `pdserve ctl reclaim` as an operator runs them: a real subprocess
against a real router (served here, its workers fake HTTP servers that keep the worker's
`POST /internal/cpus` contract). Proves: the JSON results carry the router's fields, the
human lines say what moved where, the table shows the loan, a reclaim the borrower did not
answer says it is pinned back later, and a refusal exits 1 with the router's message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from tests.ctl.test_ctl import _secret, ctl
from tests.router.test_core_lending import Cluster, PinningWorker, cluster, pair


def test_lend_and_reclaim_as_json_and_as_lines(tiny_model: Callable[..., Path],
                                               tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    fakes = {**pair(), "col": PinningWorker("collocated", [2, 3])}

    async def go() -> None:
        async with cluster(tiny_model, fakes) as c:
            await lend_and_reclaim(c, secret)

    asyncio.run(go())


async def lend_and_reclaim(c: Cluster, secret: Path) -> None:
    fakes = c.fakes
    code, out, err = await ctl(secret, c.base, "lend", "pre", "--to", "dec", "--json")
    assert code == 0, err
    lent = json.loads(out)
    assert set(lent) == {"worker", "to", "cpus", "seconds"}
    assert (lent["worker"], lent["to"], lent["cpus"]) == ("pre", "dec", [0, 1])
    assert isinstance(lent["seconds"], float)
    assert fakes["dec"].pins == [[0, 1]] and c.w("pre").state == "lent"
    code, out, err = await ctl(secret, c.base, "workers")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows == [
        ["pre", "prefill", "lent", "0", "0", "0/64", "0", c.urls["pre"], "cores", "lent", "to",
         "dec"],
        ["dec", "decode", "healthy", "0", "0", "0/64", "0-1", c.urls["dec"]],
        ["col", "collocated", "healthy", "0", "0", "0/64", "2-3", c.urls["col"]]]

    code, out, err = await ctl(secret, c.base, "reclaim", "pre", "--json")
    assert code == 0, err
    back = json.loads(out)
    assert set(back) == {"worker", "from", "cpus", "pinned_back", "seconds"}
    assert (back["worker"], back["from"], back["cpus"], back["pinned_back"]) == (
        "pre", "dec", [0], True)
    assert fakes["dec"].pins == [[0, 1], [1]] and c.w("pre").routable

    code, out, err = await ctl(secret, c.base, "lend", "pre", "--to", "col")
    assert code == 0, err
    assert out.startswith("worker pre: cores lent to col (now on 0,2,3) in ")
    assert out.rstrip().endswith(" s")
    fakes["col"].pin_answer = 503  # it does not take the pin back now
    code, out, err = await ctl(secret, c.base, "reclaim", "pre")
    assert code == 0, err
    assert out.startswith("worker pre: cores 0 back from col in ")
    assert out.rstrip().endswith(" s (col is pinned back when it answers again)")
    fakes["col"].pin_answer = 200
    assert (await c.lend("pre", "dec"))[0] == 200
    code, out, err = await ctl(secret, c.base, "reclaim", "pre")
    assert code == 0, err
    assert out.startswith("worker pre: cores 0 back from dec in ")
    assert out.rstrip().endswith(" s") and "pinned back" not in out

    code, out, err = await ctl(secret, c.base, "reclaim", "pre")
    assert (code, out) == (1, "")
    assert err.strip() == ("pdserve ctl: error: the router answered 409: worker pre has lent "
                           "no cores")
    code, out, err = await ctl(secret, c.base, "lend", "dec", "--to", "pre", "--json")
    assert (code, out) == (1, "")
    assert err.strip() == ("pdserve ctl: error: the router answered 409: worker dec is a "
                           "decode worker: only a prefill worker lends its cores (flip it to "
                           "prefill first)")
    code, _, err = await ctl(secret, c.base, "lend", "pre", "--to", "nobody")
    assert code == 1 and err.strip() == (
        "pdserve ctl: error: the router answered 404: no worker named 'nobody' in the pool")
    code, _, err = await ctl(secret, c.base, "lend", "pre")
    assert code == 2 and "--to" in err
    assert c.r.pool.healthy("prefill") == [c.w("pre")] and c.r.admin.lending.loans == {}
