"""Serving the service's ASGI app inside the caller's anyio event loop."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from starlette.types import ASGIApp

from fleetroll._internal.serving import serve_asgi
from fleetroll.errors import ConfigError

__all__ = ["serve_app"]

_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_TIMEOUT_S = 10.0


@contextlib.asynccontextmanager
async def serve_app(
    app: ASGIApp, host: str, port: int, *, before_stop: Callable[[], None] | None = None
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0: a free port) while the block runs.

    Yields the base URL. ``before_stop`` runs first on the way out (e.g. to
    end long-lived streams, which would otherwise hold the shutdown).

    Raises:
        ConfigError: the address cannot be listened on.
    """
    for name in ("mcp", "httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        async with serve_asgi(
            app,
            host=host,
            port=port,
            startup_timeout_s=_STARTUP_TIMEOUT_S,
            shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S,
            graceful_shutdown_s=3,
            backlog=2048,
        ) as url:
            try:
                yield url
            finally:
                if before_stop is not None:
                    before_stop()
    except OSError as exc:
        raise ConfigError(f"cannot serve on {host}:{port}: {exc}") from exc
