"""The front door of every server of ours: bind check, bearer token, Host
check, body size limit.

Shared by the HTTP service (``fleetroll serve``), the dashboard
(``fleetroll dashboard``) and the emulator's command, so it sits below all of
them (issue 28: imports read top-down).

* :func:`check_bind`: serving anything but loopback needs a token.
* :class:`Guard`, an ASGI middleware in front of every route (the MCP mount
  included):

  - with a token, every path but ``/healthz`` needs ``Authorization: Bearer
    <token>``, compared in constant time; 401 otherwise;
  - without one (loopback only), the ``Host`` header must name loopback, so
    a web page cannot reach the service through DNS rebinding (421);
  - request bodies over ``max_body_bytes`` get 413, whether they announce
    their length or not (the body is read, up to the limit, before the route
    runs).

Nothing here echoes what the client sent.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from fleetroll.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import SecretStr
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["MIN_TOKEN_CHARS", "Guard", "check_bind", "is_loopback"]

_OPEN_PATHS = frozenset({"/healthz"})
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: SecretStr | None) -> None:
    """Refuse to serve beyond loopback without a token.

    Raises:
        ConfigError: ``host`` is not loopback and there is no token, or the
            token is shorter than 16 characters once surrounding whitespace
            is stripped (a blank one included).
    """
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve on {host}: binding anything but loopback (127.0.0.1, ::1,"
            " localhost) requires a bearer token; set FLEETROLL_SERVICE_TOKEN to a long"
            " random secret (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    if token is not None:
        _check_token(token)


def _check_token(token: SecretStr) -> None:
    if len(token.get_secret_value().strip()) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"FLEETROLL_SERVICE_TOKEN is blank or too short: use at least {MIN_TOKEN_CHARS}"
            " characters besides surrounding whitespace"
        )


class _TooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: authentication, Host check and body limit (see the module doc).

    Raises:
        ConfigError: the token is blank or too short (as :func:`check_bind`).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: SecretStr | None,
        max_body_bytes: int,
        open_paths: Iterable[str] = _OPEN_PATHS,
        also_authorized: Callable[[str, Mapping[str, str]], bool] | None = None,
    ) -> None:
        self.app = app
        if token is not None:
            _check_token(token)
        # Stripped, as a client's header value is: a token set with a stray
        # newline (``$(cat token)``) still matches.
        self._token = token.get_secret_value().strip().encode() if token is not None else None
        self._max = max_body_bytes
        self._open = frozenset(open_paths)
        # Another credential for some paths (the dashboard's login cookie):
        # ``(path, headers) -> bool``.
        self._also = also_authorized

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if self._token is None:
            if not is_loopback(_host_name(headers.get("host", ""))):
                await _reject(send, 421, "this service only answers to loopback host names")
                return
        elif (
            scope["path"] not in self._open
            and not self._authorized(headers)
            and not (self._also is not None and self._also(scope["path"], headers))
        ):
            await _reject(
                send,
                401,
                "missing or invalid bearer token (send Authorization: Bearer <token>)",
                [(b"www-authenticate", b'Bearer realm="fleetroll"')],
            )
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max:
            await _reject(send, 413, f"request body over {self._max} bytes")
            return
        try:
            body = await self._read_body(receive)
        except _TooLarge:
            await _reject(send, 413, f"request body over {self._max} bytes")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if body is not None and not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        assert self._token is not None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(given.strip().encode(), self._token)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None when the first message is not a body (a disconnect)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _host_name(host: str) -> str:
    """The name in a Host header, without its port (``[::1]:8750`` → ``::1``)."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _reject(
    send: Send, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"detail": detail}, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
