"""Closing an ``AsyncExitStack`` as if the task groups in it were not there.

Shared by the pools, the runner and the servers of the emulator and the fake
OpenAI endpoint; standard library only, so that importing the pool loads no
web server.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from types import TracebackType

__all__ = ["exit_transparently"]


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
