"""The SDK modes' transports pick a proxy for a URL exactly as httpx's own client would.

httpx decides from the environment when it builds a client without a transport
of its own; fleetroll's clients pass theirs, so
:class:`fleetroll._internal.proxies.Proxies` decides for them. Each case below
holds its choice equal to a plain ``httpx.Client``'s for the same environment.
"""

from __future__ import annotations

import httpx
import pytest

from fleetroll._internal.proxies import Proxies

VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
URLS = (
    "http://example.com/a",
    "https://example.com/a",
    "https://www.example.com:8443/a",
    "http://wwwexample.com/a",
    "http://127.0.0.1:8080/a",
    "https://localhost/a",
    "http://internal:8080/a",
    "http://internal:9090/a",
)
ENVIRONMENTS = [
    {"HTTP_PROXY": "http://p1:3128"},
    {"HTTPS_PROXY": "http://p2:3128"},
    {"ALL_PROXY": "http://p3:3128"},
    {"HTTP_PROXY": "http://p1:3128", "HTTPS_PROXY": "http://p2:3128"},
    {"https_proxy": "p2:3128"},  # lower case, no scheme: http://
    {"ALL_PROXY": "http://p3:3128", "NO_PROXY": "example.com"},
    {"ALL_PROXY": "http://p3:3128", "NO_PROXY": ".example.com"},
    {"ALL_PROXY": "http://p3:3128", "NO_PROXY": "*"},
    {"ALL_PROXY": "http://p3:3128", "NO_PROXY": "127.0.0.1, localhost"},
    {"ALL_PROXY": "http://p3:3128", "NO_PROXY": "http://internal:8080"},
    {"HTTPS_PROXY": "http://user:secret@p2:3128", "HTTP_PROXY": "http://p1:3128"},
]


def _httpx_choice(client: httpx.Client, url: str) -> str | None:
    """The proxy httpx's own client sends ``url`` through (read off its mounted transport)."""
    transport = client._transport_for_url(httpx.URL(url))
    proxy_url = getattr(transport._pool, "_proxy_url", None)  # type: ignore[attr-defined]
    if proxy_url is None:
        return None
    return f"{proxy_url.scheme.decode()}://{proxy_url.host.decode()}:{proxy_url.port}"


def _ours(proxies: Proxies, url: str) -> str | None:
    chosen = proxies.for_url(url)
    if chosen is None:
        return None
    parsed = httpx.URL(chosen)  # credentials aside, as httpx keeps them aside
    return f"{parsed.scheme}://{parsed.host}:{parsed.port}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=lambda e: ",".join(map(str, e.items())))
def test_the_proxy_for_each_url_is_the_one_httpx_chooses(
    clean_env: pytest.MonkeyPatch, environment: dict[str, str]
) -> None:
    for name, value in environment.items():
        clean_env.setenv(name, value)
    proxies = Proxies.from_environment()
    with httpx.Client() as reference:
        theirs = {url: _httpx_choice(reference, url) for url in URLS}
    ours = {url: _ours(proxies, url) for url in URLS}
    assert ours == theirs
    assert any(theirs.values()) or environment.get("NO_PROXY") == "*"


def test_a_proxy_keeps_its_credentials_for_the_transport(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("HTTPS_PROXY", "http://user:secret@p2:3128")
    assert Proxies.from_environment().for_url("https://example.com/") == (
        "http://user:secret@p2:3128"
    )


def test_no_variable_means_no_proxy(clean_env: pytest.MonkeyPatch) -> None:
    proxies = Proxies.from_environment()
    assert proxies.rules == ()
    assert proxies.for_url("https://example.com/") is None


def test_a_socks_proxy_is_refused_by_its_scheme_without_its_password(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("ALL_PROXY", "socks5://user:hunter2@p4:1080")
    with pytest.raises(ValueError, match="socks5://") as caught:
        Proxies.from_environment()
    assert "hunter2" not in str(caught.value)
