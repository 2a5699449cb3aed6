"""Who may call the router: API keys (hashed, compared in constant time, OpenAI's 401), a
token bucket per key or per client address (OpenAI's 429 with Retry-After), a key on /metrics,
/health public; and the flags that set them, refused before anything loads."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pdserve import cli
from pdserve.bearer import KeySet
from pdserve.router.access import AccessSettings, access_middleware, redacted
from pdserve.router.app import add_router_args, settings_from_args
from pdserve.router.rate_limit import RateLimit
from tests.http_app import serving

KEY, OTHER = "sk-test-0123456789abcdef", "sk-next-fedcba9876543210"
METRICS_KEY = "metrics-0123456789abcdef"
REFUSED: list[int] = []  # statuses the middleware reported refusing


def test_a_key_set_accepts_exactly_its_keys_and_names_them_by_digest() -> None:
    keys = KeySet([KEY, OTHER])
    one, two = keys.identity(f"Bearer {KEY}"), keys.identity(f"bearer  {OTHER} ")
    assert one is not None and two is not None and one != two
    assert KEY.encode() not in one and len(one) == 32  # a digest, not the key
    for bad in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
                "Bearer ", f"Bearer {KEY.upper()}"):
        assert keys.identity(bad) is None, bad
    assert KEY not in repr(keys)


def test_a_refusal_never_echoes_the_whole_key() -> None:
    assert redacted(f"Bearer {KEY}") == "sk-" + "*" * 16 + "cdef"
    assert redacted("Bearer short") == "****"
    assert redacted(None) == "****"
    assert redacted("Bearer sk-\x01abcdefghijklmn") == "****"


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _app(access: AccessSettings, clock=None) -> web.Application:
    app = web.Application()
    for path in ("/v1/models", "/health", "/metrics"):
        app.router.add_get(path, _hello)
    app.router.add_post("/v1/completions", _hello)
    app.middlewares.append(access_middleware(access, REFUSED.append,
                                             *([clock] if clock else [])))
    return app


async def _get(session: aiohttp.ClientSession, url: str, key: str | None = None
               ) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url, headers=headers) as r:
        return r.status, await r.json(), dict(r.headers)


def test_v1_needs_a_key_health_does_not_and_metrics_follows_its_own_key() -> None:
    access = AccessSettings(api_keys=KeySet([KEY]), metrics_keys=KeySet([METRICS_KEY]))

    async def go() -> None:
        async with serving(_app(access)) as url, aiohttp.ClientSession() as s:
            status, body, headers = await _get(s, url + "/v1/models")
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
            assert body["error"]["code"] == "invalid_api_key"
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith("You didn't provide an API key.")
            status, body, _ = await _get(s, url + "/v1/models", OTHER)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert body["error"]["message"] == "Incorrect API key provided: sk-" + \
                "*" * 16 + "3210."
            assert OTHER not in body["error"]["message"]
            async with s.post(url + "/v1/completions", data=b"x" * 100_000) as r:
                assert r.status == 401
            assert (await _get(s, url + "/v1/models", KEY))[:2] == (200, {"ok": True})
            assert (await _get(s, url + "/health"))[0] == 200
            assert (await _get(s, url + "/metrics"))[0] == 401
            assert (await _get(s, url + "/metrics", KEY))[0] == 401
            assert (await _get(s, url + "/metrics", METRICS_KEY))[0] == 200
            assert REFUSED[-3:] == [401, 401, 401]  # /metrics refusals are not /v1's

    asyncio.run(go())


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_limit_is_per_key_with_openais_429_and_retry_after() -> None:
    clock = Clock()
    access = AccessSettings(api_keys=KeySet([KEY, OTHER]), rate_limit=RateLimit(0.5, 2))

    async def go() -> None:
        async with serving(_app(access, clock)) as url, aiohttp.ClientSession() as s:
            for _ in range(2):
                assert (await _get(s, url + "/v1/models", KEY))[0] == 200
            status, body, headers = await _get(s, url + "/v1/models", KEY)
            assert status == 429 and headers["Retry-After"] == "2"
            assert body["error"]["type"] == "requests"
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert "0.5 per second (burst 2) per API key" in body["error"]["message"]
            assert (await _get(s, url + "/v1/models", OTHER))[0] == 200  # its own bucket
            assert (await _get(s, url + "/v1/models"))[0] == 401  # no key: not counted
            assert (await _get(s, url + "/health"))[0] == 200  # never limited
            clock.now += 1.5
            status, _, headers = await _get(s, url + "/v1/models", KEY)
            assert status == 429 and headers["Retry-After"] == "1"
            clock.now += 0.5
            assert (await _get(s, url + "/v1/models", KEY))[0] == 200
            assert REFUSED[-3:] == [429, 401, 429]

    asyncio.run(go())


def test_without_keys_the_limit_is_per_client_address() -> None:
    access = AccessSettings(rate_limit=RateLimit(1.0, 1))

    async def go() -> None:
        async with serving(_app(access, Clock())) as url, aiohttp.ClientSession() as s:
            assert (await _get(s, url + "/v1/models"))[0] == 200
            status, body, _ = await _get(s, url + "/v1/models", "anything")
            assert status == 429 and "per client address" in body["error"]["message"]

    asyncio.run(go())


def _parse(tmp_path: Path, *argv: str) -> argparse.Namespace:
    secret = tmp_path / "secret"
    if not secret.exists():
        secret.write_bytes(b"k" * 32)
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(["--secret-file", str(secret), "--decode", "http://127.0.0.1:1",
                         *argv])


def test_keys_come_from_flags_and_a_commented_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated in May\n{OTHER}\n\n  # old\n")
    s = settings_from_args(_parse(tmp_path, "--api-key", KEY, "--api-keys-file", str(keys),
                                  "--rate-limit", "2.5"))
    assert s.access.api_keys is not None and len(s.access.api_keys) == 2
    assert s.access.api_keys.identity(f"Bearer {OTHER}") is not None
    assert s.access.rate_limit == RateLimit(2.5, 3)
    assert KEY not in repr(s) and "k" * 32 not in repr(s)
    assert not settings_from_args(_parse(tmp_path)).access.guarded


@pytest.mark.parametrize(("argv", "message"), [
    (["--api-key", "short"], "--api-key: a key must be at least 16"),
    (["--api-key", "sk-with space-0123456789"], "--api-key: a key must be at least 16"),
    (["--api-keys-file", "/nonexistent/keys"], "cannot read --api-keys-file"),
    (["--rate-burst", "5"], "--rate-burst sizes the bucket of --rate-limit"),
    (["--rate-limit", "0"], "--rate-limit must be a positive number"),
    (["--rate-limit", "1", "--rate-burst", "0"], "--rate-burst must be at least 1"),
    (["--metrics-key-file", "/nonexistent/key"], "cannot read --metrics-key-file"),
])
def test_bad_access_flags_are_refused(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings_from_args(_parse(tmp_path, *argv))


def test_an_empty_keys_file_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        settings_from_args(_parse(tmp_path, "--api-keys-file", str(keys)))


def test_the_router_needs_the_cluster_secret_before_it_loads_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["router", "--model", str(tmp_path / "no-such-model"), "--decode", "http://x:1"]
    with pytest.raises(SystemExit):
        cli.main(base)
    assert "--secret-file" in capsys.readouterr().err
    short = tmp_path / "short"
    short.write_bytes(b"tooshort")
    assert cli.main([*base, "--secret-file", str(short)]) == 2
    err = capsys.readouterr().err
    assert f"--secret-file {short}" in err and "at least 16 bytes" in err
