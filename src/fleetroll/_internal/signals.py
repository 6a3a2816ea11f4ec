"""Waiting for the signals that stop a server."""

from __future__ import annotations

import signal

import anyio

__all__ = ["until_signalled"]


async def until_signalled() -> None:
    """Return on SIGINT or SIGTERM, so servers stop cleanly either way."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
