"""Serving an ASGI app from inside a running event loop, and leaving cleanly.

Shared by the emulator, the fake OpenAI server and the HTTP service.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import anyio
import uvicorn

__all__ = ["serve_asgi"]


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
        OSError: the server could not listen; the message says why, in a few
            words, for the caller to put after the address.
    """
    with anyio.fail_after(startup_timeout_s):  # name resolution may be slow
        await anyio.to_thread.run_sync(_check_free, host, port, abandon_on_cancel=True)
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
    failure: list[str] = []
    # Shielded: a caller cancelled (a trainer's time-out, Ctrl-C) still gets
    # uvicorn's own shutdown, which closes the listening socket. Cancelled with
    # the caller, the server left its socket open for the collector to find
    # (and its lifespan task printed a traceback). Cancelled on purpose below
    # when the shutdown takes too long.
    serving = anyio.CancelScope(shield=True)

    async def serve() -> None:
        try:
            with serving:
                await server.serve()
        except SystemExit:
            # uvicorn logs why and exits (3) when it cannot bind: a port taken
            # since _check_free looked. Raised here it would end the process
            # with a traceback from inside this task group.
            failure.append("the server could not start (see the line above)")
        finally:
            stopped.set()

    listening = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            try:
                with anyio.fail_after(startup_timeout_s):
                    while not server.started:
                        if stopped.is_set():
                            why = failure[0] if failure else "the server stopped"
                            raise OSError(why)
                        await anyio.sleep(0.005)
                address = server.servers[0].sockets[0].getsockname()
                listening = True
                yield f"http://{_shown(address[0])}:{address[1]}"
            finally:
                server.should_exit = True
                with anyio.move_on_after(shutdown_timeout_s, shield=True):
                    await stopped.wait()
                serving.cancel()  # the shutdown took too long (or never began)
                for listener in getattr(server, "servers", ()):
                    listener.close()  # a shutdown cut short closes nothing itself
    except BaseExceptionGroup as group:
        # Not yet serving: the caller gets the OSError itself (the task group
        # wraps it), which the commands turn into one line.
        if not listening and len(group.exceptions) == 1:
            (only,) = group.exceptions
            if isinstance(only, OSError):  # TimeoutError included
                raise only from None
        raise


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _check_free(host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will, and let go: a clear error before uvicorn's.

    Raises:
        OSError: the address cannot be bound (taken, not this machine's, no permission).
    """
    if not 0 <= port <= 65535:
        raise OSError("ports go from 0 to 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise OSError(f"cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind(address)
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise OSError(reason) from None
