"""Many policy servers: which one serves each call of a rollout.

A training run serves its model from several inference servers. What a
rollout wants from them (``policy.base_urls``):

- **Stickiness.** A rollout's calls all go to one server, so that its prefix
  cache holds the conversation. The server is chosen at the rollout's first
  call and kept (:class:`Affinity`).
- **Room.** A new rollout goes to the healthy server with the fewest calls in
  flight (ties taken in turn), and a server takes at most
  ``policy.max_calls_per_server`` calls at once: the rest wait their turn.
- **Health.** A server that fails ``policy.eject_after_failures`` calls in a
  row (it cannot be reached, or answers 5xx) is ejected for
  ``policy.eject_s``: its rollouts move to another server at their next call
  (the prefix cache is lost, the conversation is not: it is sent whole). When
  every server is ejected, calls go where they would anyway: trying beats
  failing. An ejected server comes back when its time is up; one more failure
  then ejects it again, one success makes it healthy.

The router knows nothing of chat completions: :class:`PolicyServers` is used
by :class:`~fleetroll.policies.openai.OpenAIChatPolicy` and is meant for any
other caller of the servers (a per-rollout gateway) that holds one
:class:`Affinity` per rollout. The built-in agent loop binds one per rollout
with :func:`sticky`; the policy finds it with :func:`current_affinity`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import anyio
import httpx

__all__ = [
    "Affinity",
    "PolicyServers",
    "Server",
    "ServerLimits",
    "current_affinity",
    "shown_url",
    "sticky",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """How many calls a server takes and when it is ejected.

    Args:
        max_calls: calls in flight per server (``policy.max_calls_per_server``);
            None: no cap.
        eject_after_failures: failed calls in a row that eject a server
            (``policy.eject_after_failures``).
        eject_s: how long an ejected server is left out (``policy.eject_s``).

    Raises:
        ValueError: a number is out of range.
    """

    max_calls: int | None = None
    eject_after_failures: int = 2
    eject_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_calls is not None and self.max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 or None, not {self.max_calls}")
        if self.eject_after_failures < 1:
            raise ValueError(f"eject_after_failures must be >= 1, not {self.eject_after_failures}")
        if self.eject_s <= 0:
            raise ValueError(f"eject_s must be > 0, not {self.eject_s}")


def shown_url(url: str) -> str:
    """``url`` without user, password, query or fragment: safe for results and logs."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "(an invalid URL)"
    return str(parsed.copy_with(userinfo=b"", query=None, fragment=None)).rstrip("/")


class Server:
    """One policy server and what the router knows of it."""

    def __init__(self, url: str, max_calls: int | None) -> None:
        #: The API root as configured (it may hold credentials: never show it).
        self.url = url.rstrip("/")
        #: The API root without credentials: what results and messages show.
        self.name = shown_url(url)
        #: Calls sent to it that have not ended, those waiting for its cap included.
        self.in_flight = 0
        #: Calls that failed in a row (reset by a success).
        self.failures = 0
        #: Until when (``anyio.current_time()``) it is ejected.
        self.ejected_until = -math.inf
        #: Calls it answered (any answer that is not a server failure).
        self.served = 0
        self.limiter = anyio.CapacityLimiter(math.inf if max_calls is None else max_calls)

    def __repr__(self) -> str:
        return f"Server({self.name!r}, in_flight={self.in_flight}, failures={self.failures})"


class Affinity:
    """One rollout's tie to a server: chosen at its first call, kept while healthy."""

    __slots__ = ("server", "used")

    def __init__(self) -> None:
        #: The server its next call goes to, unless ejected (None: not chosen yet).
        self.server: Server | None = None
        #: The servers it was sent to, in order, each once.
        self.used: list[Server] = []


class PolicyServers:
    """Routes each rollout's calls to one of ``urls`` (see the module's docstring).

    Args:
        urls: the servers' API roots (``…/v1``), at least one.
        limits: the cap and the ejection rule.
        clock: the time, ``anyio.current_time`` by default (tests pass their own).

    Raises:
        ValueError: no URL, or the same URL twice.
    """

    def __init__(
        self,
        urls: Sequence[str],
        limits: ServerLimits | None = None,
        *,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        if not urls:
            raise ValueError("at least one policy server is needed")
        limits = limits or ServerLimits()
        self.servers = tuple(Server(url, limits.max_calls) for url in urls)
        if len({server.url for server in self.servers}) < len(self.servers):
            raise ValueError(f"a policy server is listed twice: {[s.name for s in self.servers]}")
        self.limits = limits
        self._clock = clock
        self._next = 0  # which of the tied servers takes the next new rollout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[server.name for server in self.servers]!r})"

    def healthy(self, server: Server) -> bool:
        """Whether ``server`` is not ejected now."""
        return self._clock() >= server.ejected_until

    def choose(self, affinity: Affinity) -> Server:
        """The server ``affinity``'s next call goes to (and keep it there).

        Its own server while that is healthy; otherwise the healthy server with
        the fewest calls in flight, ties taken in turn.
        """
        current = affinity.server
        if current is not None and current in self.servers and self.healthy(current):
            return current
        candidates = [server for server in self.servers if self.healthy(server)]
        if not candidates:  # every one is ejected: trying beats failing
            if current is not None and current in self.servers:
                return current
            candidates = list(self.servers)
        fewest = min(server.in_flight for server in candidates)
        tied = [server for server in candidates if server.in_flight == fewest]
        server = tied[self._next % len(tied)]
        self._next += 1
        if current is not None and current is not server:
            _log.info("a rollout moves from policy server %s to %s", current.name, server.name)
        affinity.server = server
        if server not in affinity.used:
            affinity.used.append(server)
        return server

    @asynccontextmanager
    async def call(self, affinity: Affinity | None = None) -> AsyncIterator[Server]:
        """One call: yields the server to send it to, once its cap lets it in.

        Without ``affinity`` (a caller outside a rollout) the call is routed as
        a new rollout's first. Tell the router how it went with
        :meth:`succeeded` or :meth:`failed`; a call that says neither (it was
        cancelled) leaves the server's health as it was.
        """
        server = self.choose(affinity if affinity is not None else Affinity())
        server.in_flight += 1
        token = object()  # the borrower: a task may make calls for many rollouts
        try:
            await server.limiter.acquire_on_behalf_of(token)
            try:
                yield server
            finally:
                server.limiter.release_on_behalf_of(token)
        finally:
            server.in_flight -= 1

    def succeeded(self, server: Server) -> None:
        """``server`` answered: it is healthy again."""
        server.failures = 0
        server.served += 1

    def failed(self, server: Server) -> None:
        """``server`` could not be reached or failed the call (5xx).

        At ``eject_after_failures`` failures in a row it is ejected for ``eject_s``.
        """
        server.failures += 1
        if server.failures >= self.limits.eject_after_failures and self.healthy(server):
            server.ejected_until = self._clock() + self.limits.eject_s
            _log.warning(
                "policy server %s failed %d calls in a row: left out for %g s"
                " (policy.eject_s); its rollouts go on elsewhere",
                server.name,
                server.failures,
                self.limits.eject_s,
            )


_current: ContextVar[Affinity | None] = ContextVar("fleetroll_policy_affinity", default=None)


@contextmanager
def sticky() -> Iterator[Affinity]:
    """Policy calls made in this context are one rollout's: they share one :class:`Affinity`."""
    affinity = Affinity()
    token = _current.set(affinity)
    try:
        yield affinity
    finally:
        _current.reset(token)


def current_affinity() -> Affinity | None:
    """The :class:`Affinity` bound by :func:`sticky` around this call, if any."""
    return _current.get()
