"""Leases on shared servers: how many rollouts use one ``environment.url`` at once.

A server that is already running (``environment.url``) holds one state for
everyone who talks to it: two rollouts on it at once would reset and change
each other's state, and a verifier would score the other's work. So a
rollout takes a lease on its server's URL before its reset and gives it back
once it is verified and released; at most the task's
``environment.max_concurrent_rollouts`` (default 1) hold one at a time, and
the others wait in turn (first come, first served).

Tasks on the same URL share one limit. When they declare different numbers,
the smallest declared so far applies (a server that one task says serves
one rollout at a time is not given four by another).
"""

from __future__ import annotations

import anyio

__all__ = ["ServerLeases"]


class ServerLeases:
    """Per server URL, a :class:`anyio.CapacityLimiter` of its rollouts.

    ``holder`` is any object unique to the rollout (its environment's
    handle): the lease is the holder's until :meth:`release`.
    """

    def __init__(self) -> None:
        self._limiters: dict[str, anyio.CapacityLimiter] = {}

    async def acquire(self, url: str, limit: int, holder: object) -> None:
        """Wait until ``holder`` may use the server at ``url`` (at most ``limit`` at once).

        Cancellable: a holder cancelled while it waits holds nothing.
        """
        limiter = self._limiters.get(url)
        if limiter is None:
            limiter = self._limiters[url] = anyio.CapacityLimiter(limit)
        elif limit < limiter.total_tokens:
            limiter.total_tokens = limit  # holders keep theirs; no new one until below
        await limiter.acquire_on_behalf_of(holder)

    def release(self, url: str, holder: object) -> None:
        """Give back ``holder``'s lease on ``url`` (the next in line gets it)."""
        self._limiters[url].release_on_behalf_of(holder)

    def held(self, url: str) -> int:
        """Leases on ``url`` held now."""
        limiter = self._limiters.get(url)
        return 0 if limiter is None else limiter.borrowed_tokens

    def waiting(self, url: str) -> int:
        """Rollouts waiting for a lease on ``url`` now."""
        limiter = self._limiters.get(url)
        return 0 if limiter is None else limiter.statistics().tasks_waiting

    def limit(self, url: str) -> int | None:
        """The limit that applies to ``url`` (None before its first lease)."""
        limiter = self._limiters.get(url)
        return None if limiter is None else int(limiter.total_tokens)
