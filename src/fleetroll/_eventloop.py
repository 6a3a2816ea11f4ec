"""The event loop every fleetroll command runs on: uvloop where it is installed.

fleetroll is CPU-bound at high concurrency (thousands of HTTP requests a
second on one loop), and uvloop's loop and socket transports cost less CPU
per request than asyncio's: measured with ``fleetroll bench`` (see
benchmarks/RESULTS.md). The plain asyncio loop is used where uvloop is not
available (Windows) or when ``FLEETROLL_EVENT_LOOP=asyncio`` asks for it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple

import anyio

__all__ = ["loop_name", "run"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_ENV = "FLEETROLL_EVENT_LOOP"


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop :func:`run` will use."""
    wanted = os.environ.get(_ENV, "uvloop").strip().lower()
    if wanted == "uvloop" and importlib.util.find_spec("uvloop") is not None:
        return "uvloop"
    return "asyncio"


def run(func: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> T:
    """``anyio.run(func, *args)`` on the loop :func:`loop_name` picks."""
    return anyio.run(func, *args, backend_options={"use_uvloop": loop_name() == "uvloop"})
