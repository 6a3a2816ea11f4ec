"""Answers pre-flight may reuse for a while, within one process.

``fleetroll serve`` checks every batch before accepting it; a trainer posts
one every few seconds. Fleet's environment listing and a policy endpoint
that answered do not change that often, so the service keeps them for
``service.preflight_cache_s`` instead of asking again on every request.

Only good answers are kept (a listing, an endpoint that answered): a problem
is always asked again, so fixing it is seen at once. One lock per key makes a
burst of requests on a cold cache ask once. Kept apart from
:mod:`fleetroll.pool.preflight` (which re-exports it) so that the Fleet provider
can use it without an import cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

__all__ = ["PreflightCache"]

V = TypeVar("V")

#: Keys past which expired values (and idle locks) are dropped on the next put.
#: Not a setting: keys are endpoints and control planes, a handful in practice.
_PRUNE_AT = 64


class PreflightCache(Generic[V]):
    """Values by key, each good for ``ttl_s`` after it was put (0: never kept).

    Args:
        ttl_s: how long a value is fresh, in seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._values: dict[str, tuple[float, V]] = {}
        self._locks: dict[str, anyio.Lock] = {}

    def get(self, key: str) -> V | None:
        """The value under ``key`` if still fresh, else None."""
        kept = self._values.get(key)
        if kept is None:
            return None
        expires, value = kept
        if self._clock() >= expires:
            del self._values[key]
            return None
        return value

    def put(self, key: str, value: V) -> None:
        """Keep ``value`` under ``key`` for ``ttl_s`` (not at all when it is 0)."""
        if self.ttl_s <= 0:
            return
        now = self._clock()
        if len(self._values) >= _PRUNE_AT or len(self._locks) >= _PRUNE_AT:
            self._values = {k: kept for k, kept in self._values.items() if kept[0] > now}
            self._locks = {
                k: lock for k, lock in self._locks.items() if lock.locked() or k in self._values
            }
        self._values[key] = (now + self.ttl_s, value)

    def lock(self, key: str) -> anyio.Lock:
        """The lock to hold while looking up and fetching ``key``: one fetch at a time."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = anyio.Lock()
        return lock
