"""An MCP server whose ``big`` tool answers with ``--size`` bytes: for tests of the caps.

Speaks just enough of MCP (JSON-RPC 2.0: ``initialize``, ``tools/list``,
``tools/call``, ``ping``) over stdio (``stdio``) or streamable HTTP with JSON
answers (``http``: prints ``port N`` once listening on 127.0.0.1). The big
answer is written in 1 MiB pieces and never held whole, so the server's own
memory stays small. Tools: ``big`` (``--size`` bytes of text), ``small``
("ok"), ``score`` ("1", a verifier), and with ``--tools N`` that many more
(``tool_<i>``), for a listing as large as wanted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Any

PIECE = 1024 * 1024


def listing(extra: int) -> dict[str, Any]:
    schema = {"type": "object", "properties": {}}
    tools = [
        {"name": "big", "description": "A large answer.", "inputSchema": schema},
        {"name": "small", "description": "A small answer.", "inputSchema": schema},
        {"name": "score", "description": "The verifier: 1.", "inputSchema": schema},
    ]
    tools += [
        {"name": f"tool_{i}", "description": "x" * 200, "inputSchema": schema} for i in range(extra)
    ]
    return {"tools": tools}


#: What the big answer repeats (``--filler``: e.g. credential-like words, which
#: make redaction slow).
FILLER = [b"x"]


def answer(message: dict[str, Any], size: int, extra: int) -> Iterator[bytes] | None:
    """The answer's bytes (no newline), or None for a notification."""
    method, rid = message.get("method"), message.get("id")
    if rid is None:
        return None
    head = b'{"jsonrpc":"2.0","id":' + json.dumps(rid).encode()
    if method == "tools/call" and message["params"]["name"] == "big":
        text_head = b',"result":{"content":[{"type":"text","text":"'

        def pieces() -> Iterator[bytes]:
            yield head + text_head
            left = size
            while left > 0:
                yield (FILLER[0] * (PIECE // len(FILLER[0]) + 1))[: min(PIECE, left)]
                left -= PIECE
            yield b'"}]}}'

        return pieces()
    if method == "initialize":
        result: Any = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "big", "version": "1"},
        }
    elif method == "tools/list":
        result = listing(extra)
    elif method == "tools/call":
        text = "1" if message["params"]["name"] == "score" else "ok"
        result = {"content": [{"type": "text", "text": text}]}
    elif method == "ping":
        result = {}
    else:
        error = {"code": -32601, "message": f"no method {method}"}
        return iter([head + b',"error":' + json.dumps(error).encode() + b"}"])
    return iter([head + b',"result":' + json.dumps(result).encode() + b"}"])


def stdio(size: int, extra: int) -> None:
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        pieces = answer(json.loads(line), size, extra)
        if pieces is None:
            continue
        try:
            for piece in pieces:
                out.write(piece)
            out.write(b"\n")
            out.flush()
        except BrokenPipeError:
            return


def http(size: int, extra: int) -> None:
    from aiohttp import web

    async def post(request: web.Request) -> web.StreamResponse:
        pieces = answer(await request.json(), size, extra)
        if pieces is None:
            return web.Response(status=202)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            for piece in pieces:
                await response.write(piece)
        except (ConnectionError, RuntimeError):  # the client stopped reading: fine
            return response
        await response.write_eof()
        return response

    async def other(request: web.Request) -> web.Response:
        return web.Response(status=405)

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/mcp", post)
    app.router.add_route("*", "/mcp", other)

    runner = web.AppRunner(app, access_log=None)

    async def main() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"port {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["stdio", "http"])
    parser.add_argument("--size", type=int, default=200 * 1024 * 1024)
    parser.add_argument("--tools", type=int, default=0)
    parser.add_argument("--filler", default="x")
    args = parser.parse_args()
    FILLER[0] = args.filler.encode()
    (stdio if args.mode == "stdio" else http)(args.size, args.tools)
