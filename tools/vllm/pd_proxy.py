"""A small OpenAI-compatible proxy in front of vLLM prefill and decode servers (NixlConnector).

It speaks vLLM's P/D hand-over protocol, the one vLLM's own test proxy uses:

1. The request goes to a prefill server as a non-streaming, one-token request with
   `kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false}`. The prefill
   server computes the prompt's KV cache, keeps its blocks, and answers with the
   `kv_transfer_params` a decode server needs to pull them (engine id, block ids, host, port).
2. The original request, with those `kv_transfer_params` added, goes to a decode server, which
   reads the KV blocks over NIXL and generates; its answer (streamed or not) is passed through
   byte for byte, so usage chunks, `[DONE]` and errors look exactly as vLLM sends them.

Run it with /work/vllm-venv/bin/python (it needs only aiohttp, which vLLM depends on):

    python pd_proxy.py --port 8200 --prefill http://127.0.0.1:8201 --decode http://127.0.0.1:8202

Several --prefill/--decode URLs are used round-robin. Endpoints: POST /v1/completions,
POST /v1/chat/completions, GET /v1/models (from a decode server), GET /health (200 only when
every upstream answers 200).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import uuid

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
               "content-encoding"}


def prefill_body(body: dict) -> dict:
    """The request as the prefill server must see it: one token, not streamed, KV kept."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self._next_decode = itertools.cycle(self.decode_urls)
        self.session: ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        self.session = ClientSession(connector=TCPConnector(limit=0),
                                     timeout=ClientTimeout(total=None))

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        path = request.path  # /v1/completions or /v1/chat/completions
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]

        # 1. Prefill: compute the prompt's KV cache, learn where the decode server finds it.
        prefill_url = next(self._next_prefill) + path
        try:
            async with self.session.post(prefill_url, json=prefill_body(body),
                                         headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:  # vLLM's own error (bad request, too long...): pass on
                    return web.Response(status=resp.status, body=raw,
                                        content_type=resp.content_type)
                answer = json.loads(raw)
        except OSError as exc:
            return _error(502, f"prefill server {prefill_url} unreachable: {exc}")
        params = answer.get("kv_transfer_params")
        decode_body = dict(body)
        if params:
            decode_body["kv_transfer_params"] = params

        # 2. Decode: pull the KV blocks, generate, stream the answer through unchanged.
        decode_url = next(self._next_decode) + path
        try:
            async with self.session.post(decode_url, json=decode_body, headers=headers) as resp:
                out = web.StreamResponse(status=resp.status, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except OSError as exc:
            return _error(502, f"decode server {decode_url} unreachable: {exc}")

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        url = self.decode_urls[0] + "/v1/models"
        try:
            async with self.session.get(url) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type=resp.content_type)
        except OSError as exc:
            return _error(502, f"decode server {url} unreachable: {exc}")

    async def health(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        bad = []
        for base in self.prefill_urls + self.decode_urls:
            try:
                async with self.session.get(base + "/health",
                                            timeout=ClientTimeout(total=5)) as resp:
                    if resp.status != 200:
                        bad.append(f"{base}: HTTP {resp.status}")
            except (TimeoutError, OSError) as exc:
                bad.append(f"{base}: {exc or type(exc).__name__}")
        if bad:
            return web.Response(status=503, text="; ".join(bad))
        return web.Response(status=200)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error",
                                        "code": status}}, status=status)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="base URLs of vLLM prefill servers (http://host:port)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="base URLs of vLLM decode servers (http://host:port)")
    args = p.parse_args(argv)

    proxy = Proxy(args.prefill, args.decode)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    print(f"pd_proxy: http://{args.host}:{args.port}/v1 -> prefill {args.prefill}, "
          f"decode {args.decode}", file=sys.stderr, flush=True)
    # run_app turns SIGINT and SIGTERM into a clean shutdown by itself.
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
