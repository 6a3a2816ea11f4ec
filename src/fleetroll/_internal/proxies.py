"""The proxy a URL goes through, read from the environment by httpx's own rules.

httpx reads ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY``
(either case) when a client is built without a transport of its own. The
SDK modes' clients (``pool.mcp_client = "sdk"``,
``provisioning.control_client = "sdk"``) pass theirs
(:mod:`fleetroll._internal.http_transport`), which switches that off: this
module gives those transports the same answer httpx would have given, from
the same rules (``httpx``'s ``get_environment_proxies`` and ``URLPattern``,
matched most specific first, as ``httpx.AsyncClient`` mounts them), so a
proxy and a ``NO_PROXY`` entry mean the same in every mode.

The environment is read once, when :meth:`Proxies.from_environment` runs
(as httpx reads it when a client is built).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx
from httpx._utils import URLPattern, get_environment_proxies

__all__ = ["Proxies"]

T = TypeVar("T")

#: Proxy schemes the aiohttp transports can speak (CONNECT for https targets).
_SCHEMES = ("http", "https")


class _Url(Protocol):
    """What a rule looks at: an ``httpx.URL`` or ``httpx2.URL``."""

    @property
    def scheme(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Proxies:
    """Rules from URL patterns to a proxy URL (``None``: straight to the host).

    Build it with :meth:`from_environment`; ``Proxies()`` sends everything directly.
    """

    rules: tuple[tuple[URLPattern, str | None], ...] = ()
    _chosen: dict[tuple[str, str, int | None], str | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def from_environment(cls) -> Proxies:
        """The rules of ``HTTP(S)_PROXY``, ``ALL_PROXY`` and ``NO_PROXY``, now.

        Raises:
            ValueError: a proxy URL of a scheme other than http or https (a
                SOCKS proxy); the message names the scheme, never the URL
                (it may hold a password).
        """
        rules: list[tuple[URLPattern, str | None]] = []
        for key, url in get_environment_proxies().items():
            if url is not None:
                scheme = httpx.URL(url).scheme
                if scheme not in _SCHEMES:
                    variable = f"{key.removesuffix('://').upper()}_PROXY"
                    raise ValueError(
                        f"{variable} names a {scheme}:// proxy; fleetroll's HTTP clients go"
                        " through http:// or https:// proxies only (unset it, or name an"
                        " http:// proxy)"
                    )
            rules.append((URLPattern(key), url))
        # As httpx mounts them: the most specific pattern first (port, host, scheme).
        rules.sort(key=lambda rule: rule[0].priority)
        return cls(tuple(rules))

    @classmethod
    def through(cls, proxy: str) -> Proxies:
        """Every URL through ``proxy`` (a client's ``proxy=``)."""
        return cls(((URLPattern("all://"), proxy),))

    def shown_for(self, url: _Url | str) -> str | None:
        """The proxy for ``url`` as messages may show it (no credentials), or ``None``."""
        proxy = self.for_url(url)
        if proxy is None:
            return None
        return str(httpx.URL(proxy).copy_with(username=None, password=None))

    def for_url(self, url: _Url | str) -> str | None:
        """The proxy URL for a request to ``url`` (with its credentials, if any), or ``None``."""
        if not self.rules:
            return None
        target: Any = httpx.URL(url) if isinstance(url, str) else url
        key = (target.scheme, target.host, target.port)
        try:
            return self._chosen[key]
        except KeyError:
            pass
        chosen = next((proxy for pattern, proxy in self.rules if pattern.matches(target)), None)
        if len(self._chosen) >= 4096:
            self._chosen.clear()
        self._chosen[key] = chosen
        return chosen

    def mounts(self, through: Callable[[str], T]) -> dict[str, T | None]:
        """The rules as an httpx client's ``mounts``: ``through(proxy_url)`` for each proxy,
        ``None`` (the client's own transport) where ``NO_PROXY`` sends requests directly."""
        return {
            pattern.pattern: None if proxy is None else through(proxy)
            for pattern, proxy in self.rules
        }
