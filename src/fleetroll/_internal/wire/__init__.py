"""A small HTTP/1.1 keep-alive client for the hot path.

A rollout's requests (create, reset, MCP calls, verification, release) are
small JSON exchanges; through httpx (or httpx2) and their transports each
cost several times the bytes' own work. :class:`Wire` sends them on
asyncio protocol connections and parses answers with httptools' compiled
parser: one idle-connection list per route, no request or response models.
It behaves as httpx does wherever the two could differ on the wire; every
such rule is resolved when the Wire is built or the first time a URL is
seen, never per request.

Contracts:

* Deadlines are the caller's (``anyio.fail_after``, cancel scopes); a
  request cancelled or failed mid-way closes its connection, which is never
  reused. A connection is reused only after an answer read to its end that
  allows it, and for at most ``keepalive_s`` of idleness; an idle connection
  the server already closed (its socket readable, as httpcore checks) is
  dropped before it is used.
* Answers are read as httpx reads them: interim ones (``100 Continue``,
  ``103 Early Hints``) are skipped; the answer to a ``HEAD`` ends at its
  head whatever its length says (its connection is then closed).
* :class:`ConnectFailed`: no connection could be opened, the request
  provably never left (safe to send again, a POST too).
  :class:`ConnectionLost`: the connection broke after the request may have
  left. :class:`BodyTooLarge`: the answer passed ``max_bytes`` (reading
  stopped there, the connection was closed). :class:`BadResponse`: the
  bytes are not HTTP/1.1 as the parser knows it, the header block is over
  100 KiB (httpcore's limit; reading stops there), or the body is in an
  encoding the Wire cannot decode. :class:`ProxyError`: the proxy refused
  to open a tunnel.
* Sent again: a request on a reused idle connection that the server closed
  before answering a byte, on a new connection, only when sending it twice
  is harmless: an idempotent method (GET, HEAD, OPTIONS, PUT, DELETE,
  TRACE), or a request its caller marks ``idempotent=True`` (the control
  plane's create, whose ``X-Request-ID`` Fleet answers idempotently). Any
  other POST is never sent twice.
* Encodings: every request says ``Accept-Encoding: identity`` unless the
  caller set one; an answer in ``gzip`` or ``deflate`` anyway is decoded as
  it arrives, with ``max_bytes`` applied to the decoded size (a zip bomb is
  :class:`BodyTooLarge`); any other encoding (``br``, ``zstd``) is a
  :class:`BadResponse` naming it (httpx would hand back the raw bytes).
* Proxies as httpx's ``trust_env`` reads them when the Wire is built:
  ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (either
  case, through :func:`urllib.request.getproxies`), with httpx's matching
  rules (``*`` turns proxies off; a name matches itself and its subdomains,
  a leading dot only subdomains; an IP address or ``localhost`` itself; a
  ``host:port`` entry that port only; a range such as ``10.0.0.0/8`` only
  its first address, as in httpx). ``proxy=`` overrides the environment for
  every URL, ``trust_env=False`` ignores it. ``http://`` targets go to the
  proxy in absolute form, ``https://`` ones through a ``CONNECT`` tunnel and
  TLS to the target itself; the proxy URL's user info becomes
  ``Proxy-Authorization: Basic``. Tunnelled, proxied and direct connections
  never share an idle list.
* A URL's user info (``http://user:pw@host/``) becomes ``Authorization:
  Basic`` (percent-decoded, as httpx does, and in its place: it wins over an
  ``Authorization`` the caller set) and appears in no ``Host`` header and
  no error message; nor does a proxy's.
* :meth:`Wire.stream` hands over status and headers as soon as they arrive
  and the body chunk by chunk (decoded, capped); its connection is reused
  only when the whole answer arrived, closed otherwise (the caller left
  early, was cancelled, or the answer failed).

The modules, by idea: :mod:`~fleetroll._internal.wire.client` (the Wire:
connections pooled per route, URLs split, the retry loop, a stream's context),
:mod:`~fleetroll._internal.wire.connection` (one connection: the request
out, the answer parsed), :mod:`~fleetroll._internal.wire.decoding`
(content encodings), :mod:`~fleetroll._internal.wire.proxy` (proxy URLs and
``CONNECT`` tunnels), :mod:`~fleetroll._internal.wire.stream` (the answer
whose body is read as it arrives), :mod:`~fleetroll._internal.wire.errors`.
"""

from fleetroll._internal.wire.client import Wire
from fleetroll._internal.wire.connection import Response
from fleetroll._internal.wire.errors import (
    BadResponse,
    BodyTooLarge,
    ConnectFailed,
    ConnectionLost,
    ProxyError,
    WireError,
)
from fleetroll._internal.wire.stream import StreamResponse

__all__ = [
    "BadResponse",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectionLost",
    "ProxyError",
    "Response",
    "StreamResponse",
    "Wire",
    "WireError",
]
