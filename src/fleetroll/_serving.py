"""Serving an ASGI app from inside a running event loop, and leaving cleanly.

Shared by the emulator, the fake OpenAI server and the HTTP service.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Literal

import anyio
import uvicorn

__all__ = ["exit_transparently", "serve_asgi"]


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the host process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    lifespan: Literal["auto", "on", "off"] = "on",
    startup_timeout_s: float = 30.0,
    shutdown_timeout_s: float = 10.0,
    graceful_shutdown_s: int = 1,
    keep_alive_s: int = 65,
    **config: Any,
) -> AsyncIterator[str]:
    """Serve ``app`` in a task of the current loop; yield its base URL.

    uvicorn binds the port itself (port 0: a free one): handing it a
    pre-bound socket was measured here at ~40 ms per request.

    Idle connections are kept ``keep_alive_s`` (a cloud load balancer's idle
    timeout), not uvicorn's 5 s: at 5 s the server closed connections that
    clients had just picked for their next request (91 of 1,000 rollouts
    failed that way in `fleetroll bench`). Our clients reuse an idle
    connection for less (``timeouts.http_keepalive_s``).

    Raises:
        OSError: the server could not listen.
    """
    server = _EmbeddedServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan=lifespan,
            access_log=False,
            timeout_graceful_shutdown=graceful_shutdown_s,
            timeout_keep_alive=keep_alive_s,
            **config,
        )
    )
    stopped = anyio.Event()

    async def serve() -> None:
        try:
            await server.serve()
        finally:
            stopped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        try:
            with anyio.fail_after(startup_timeout_s):
                while not server.started:
                    if stopped.is_set():
                        raise OSError(f"could not listen on {host}:{port}")
                    await anyio.sleep(0.005)
            address = server.servers[0].sockets[0].getsockname()
            shown = f"[{address[0]}]" if ":" in address[0] else address[0]
            yield f"http://{shown}:{address[1]}"
        finally:
            server.should_exit = True
            with anyio.move_on_after(shutdown_timeout_s, shield=True):
                await stopped.wait()
            tg.cancel_scope.cancel()


async def exit_transparently(
    stack: AsyncExitStack,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Close ``stack``; when a task group in it wrapped the caller's own
    exception in a group, raise that exception as it was raised."""
    try:
        await stack.__aexit__(exc_type, exc, tb)
    except BaseExceptionGroup as group:
        if exc is not None and group.exceptions == (exc,):
            raise exc from exc.__cause__
        raise
