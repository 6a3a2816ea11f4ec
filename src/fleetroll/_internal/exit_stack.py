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
    """Close ``stack``; when task groups in it wrapped the caller's own
    exception in a group (or in groups of one, one inside another), raise that
    exception as it was raised."""
    try:
        await stack.__aexit__(exc_type, exc, tb)
    except BaseExceptionGroup as group:
        if exc is not None and _only(group) is exc:
            raise exc from exc.__cause__
        raise


def _only(error: BaseException) -> BaseException:
    """The one exception inside groups of one (``error`` itself if not a group)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
