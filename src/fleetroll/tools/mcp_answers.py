"""How the thin MCP client reads an answer: the JSON-RPC envelope, as one JSON
message or a server-sent event stream, read as the SDK's transport reads it.

:func:`read_answer` reads one POST's answer as it arrives (an event stream is
left at the event of its response); :func:`answer` reads one held whole.
Either gives the response's result, or raises the ``MCPError`` the SDK's
transport would (an error response, a bare HTTP error, 202, an unknown
content type, an unparsable message), or :class:`NeedsSdk` when the server
asks the client for input, which only the SDK's client gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, cast
from urllib.parse import urlsplit

from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
)
from pydantic import ValidationError
from pydantic_core import from_json

from fleetroll._internal.wire import Response, StreamResponse

__all__ = [
    "Events",
    "NeedsSdk",
    "NotJsonRpc",
    "answer",
    "error_in",
    "mcp_error",
    "read_answer",
]


def mcp_error(code: int, message: str, data: Any = None) -> Exception:
    from mcp.shared.exceptions import MCPError  # loaded with mcp_types' server side

    return MCPError(code, message, data)


class NeedsSdk(Exception):
    """The answer asks for something only the SDK client does (client input)."""


class NotJsonRpc(Exception):
    """A message that is no JSON-RPC message (the SDK's adapter's refusal)."""


# ------------------------------------------------------------------ answers


def answer(response: Response) -> dict[str, Any]:
    """The JSON-RPC result of one POST's answer, as the SDK's transport reads it.

    Raises:
        MCPError: an error answer, or the SDK transport's stand-in for an
            answer that is not one (a bare HTTP error, 202, another content type).
        NeedsSdk: the server asked the client something in the stream.
    """
    status = response.status
    content_type = response.headers.get("content-type", "").lower()
    _check_status(status, content_type, response.headers, response.body)
    if content_type.startswith("application/json"):
        return _json_answer(response.body)
    if content_type.startswith("text/event-stream"):
        return _from_events(response.body)
    raise mcp_error(INVALID_REQUEST, f"Unexpected content type: {content_type}")


async def read_answer(response: StreamResponse, expected: int | None = None) -> dict[str, Any]:
    """The JSON-RPC result of one POST's answer (to the request ``expected``), read
    as it arrives.

    An event stream is parsed as its bytes come, and left at the event that
    carries the response (the spec lets a server keep the stream open after
    it; the SDK's transport returns there too): leaving it closes the
    connection, which is reused only when an answer was read to its end.

    Raises:
        MCPError, NeedsSdk: as :func:`answer`.
        WireError: the answer broke off or passed its cap (``BodyTooLarge``).
    """
    status = response.status
    headers = response.headers
    content_type = headers.get("content-type", "").lower()
    if status == 202 or status >= 300:
        body = await response.aread() if status >= 400 else None
        _check_status(status, content_type, headers, body)
    if content_type.startswith("text/event-stream"):
        events = Events(expected)
        async for chunk in response.aiter_bytes():
            found = events.feed(chunk)
            if found is not None:
                return found
        return events.end()
    body = await response.aread()
    if content_type.startswith("application/json"):
        return _json_answer(body, expected)
    raise mcp_error(INVALID_REQUEST, f"Unexpected content type: {content_type}")


def _check_status(
    status: int, content_type: str, headers: Mapping[str, str], body: bytes | None
) -> None:
    """Raise what the SDK's transport makes of a status that carries no result
    (``body``: the answer's, read whole, for a JSON-RPC error at 4xx/5xx).

    Raises:
        MCPError: 202, an unfollowed redirect, or an error status.
    """
    if status == 202:
        raise mcp_error(INVALID_REQUEST, "server answered a request with 202 Accepted")
    if 300 <= status < 400 and "location" in headers:
        # Shown as the SDK's transport shows it: without user info, query or fragment.
        parts = urlsplit(headers["location"])
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="")
        raise mcp_error(
            INVALID_REQUEST,
            f"Redirect to {shown.geturl()} not followed;"
            " use that URL as the endpoint if it is the intended server",
        )
    if status >= 400:
        if body is not None and content_type.startswith("application/json"):
            error = error_in(body)
            if error is not None:
                raise error
        if status == 404:
            raise mcp_error(METHOD_NOT_FOUND, "Not Found")
        raise mcp_error(INTERNAL_ERROR, "Server returned an error response")


# JSON-RPC messages are read as the SDK's transport reads them
# (``jsonrpc_message_adapter.validate_json``): pydantic-core's JSON parser, which
# refuses what Python's ``json`` lets through (a lone surrogate escape such as a
# file name that is not UTF-8, a BOM, nesting past its recursion limit; trailing
# data and invalid UTF-8 as ``json`` does) and keeps what it keeps (NaN and
# Infinity, the last of duplicate keys); then the envelope models. The usual
# envelopes are recognised here without building the models; anything else is
# decided by the SDK's own adapter, whose words its refusal carries.

_ABSENT: Final = object()


def _request_id(value: Any) -> bool:
    """A ``RequestId``: a str or (strictly) an int, never a bool or a float."""
    kind = type(value)
    return kind is int or kind is str


def _message(data: bytes | str, expected: int | None = None) -> dict[str, Any] | None:
    """One JSON-RPC message's result; None for a notification.

    ``expected``: the id of the request it answers. A response to another id
    is refused at once: read as this request's answer it would hand a rollout
    another call's result (a server off by one); the SDK's session drops it
    and waits out its read timeout, a failure of the call too.

    Raises:
        MCPError: an error response (its error), or a response to another id.
        NotJsonRpc: not a JSON-RPC message (the SDK's adapter's words).
        NeedsSdk: a request from the server.
    """
    try:
        message = from_json(data)
    except ValueError:
        message = None
    if type(message) is dict and message.get("jsonrpc") == "2.0":
        method = message.get("method", _ABSENT)
        rid = message.get("id", _ABSENT)
        if method is _ABSENT:
            result = message.get("result", _ABSENT)
            error = message.get("error", _ABSENT)
            if type(result) is dict and error is _ABSENT and _request_id(rid):
                if expected is not None and rid != expected:
                    raise _not_ours(expected, rid)
                return cast("dict[str, Any]", result)
            if type(error) is dict and result is _ABSENT and (rid is None or _request_id(rid)):
                code, text = error.get("code"), error.get("message")
                if type(code) is int and type(text) is str:
                    raise mcp_error(code, text, error.get("data"))
        elif type(method) is str and rid is _ABSENT:
            params = message.get("params")
            if params is None or type(params) is dict:
                return None  # a notification (log messages, progress)
    return _by_adapter(data, expected)


def _not_ours(expected: int, rid: object) -> Exception:
    return mcp_error(
        INTERNAL_ERROR,
        f"the server answered request {expected} with a response to request {rid!r}",
    )


def _by_adapter(data: bytes | str, expected: int | None = None) -> dict[str, Any] | None:
    """:func:`_message` of an envelope out of the usual, by the SDK's own adapter."""
    from mcp_types import JSONRPCError, JSONRPCRequest, JSONRPCResponse, jsonrpc_message_adapter

    try:
        parsed = jsonrpc_message_adapter.validate_json(data, by_name=False)
    except ValidationError as exc:
        raise NotJsonRpc(str(exc)) from None
    if isinstance(parsed, JSONRPCResponse):
        if expected is not None and parsed.id != expected:
            raise _not_ours(expected, parsed.id)
        return parsed.result
    if isinstance(parsed, JSONRPCError):
        error = parsed.error
        raise mcp_error(error.code, error.message, error.data)
    if isinstance(parsed, JSONRPCRequest):
        raise NeedsSdk(f"the server sent a {parsed.method} request")
    return None


def _json_answer(body: bytes, expected: int | None = None) -> dict[str, Any]:
    """The result of a JSON answer (one message, which must be the response to
    ``expected``, when given).

    Raises:
        MCPError: an error response, a response to another id, or
            ``PARSE_ERROR``: not a response.
    """
    try:
        result = _message(body, expected)
    except NotJsonRpc as exc:
        raise mcp_error(PARSE_ERROR, f"Failed to parse JSON response: {exc}") from None
    except NeedsSdk:
        result = None
    if result is None:  # a notification or a request where the response belongs
        raise mcp_error(PARSE_ERROR, "Failed to parse JSON response: not a JSON-RPC response")
    return result


def error_in(body: bytes) -> Exception | None:
    """The MCPError of a JSON-RPC error answer; None for any other body (the SDK's
    transport then answers from the status)."""
    try:
        _message(body)
    except (NotJsonRpc, NeedsSdk):
        return None
    except Exception as exc:  # the error response's MCPError
        return exc
    return None


class Events:
    """A server-sent event stream, parsed as its bytes arrive, up to its response.

    The SDK's transport reads it so (httpx2's ``EventSource``): lines end at
    CR, LF or CRLF, a blank line dispatches the event gathered so far; only
    ``message`` events are read, those without data (priming events) skipped;
    a notification is skipped, the first response or error ends it, whatever
    its id (the SDK's transport answers the POST's request with it); a request
    from the server is client input, the SDK's. Event data is UTF-8, an invalid
    byte read as U+FFFD (as ``aiter_text`` decodes it).
    """

    __slots__ = ("_data", "_event", "_expected", "_line", "_pending_cr")

    def __init__(self, expected: int | None = None) -> None:
        self._expected = expected  # the request's id: a response to another is refused
        self._data: list[bytes] = []
        self._event = b""
        self._line: list[bytes] = []  # the start of a line not ended yet
        self._pending_cr = False  # a chunk ended in CR: the next may start with its LF

    def feed(self, chunk: bytes) -> dict[str, Any] | None:
        """The response's result once its event is complete; None while it is not.

        Raises:
            MCPError: an error response, or a message that is not JSON-RPC.
            NeedsSdk: the server asked the client something.
        """
        if self._pending_cr:
            chunk = b"\r" + chunk
            self._pending_cr = False
        if chunk.endswith(b"\r"):
            self._pending_cr = True
            chunk = chunk[:-1]
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            if chunk:
                self._line.append(chunk)
            return None
        lines = chunk.split(b"\n")
        if self._line:
            self._line.append(lines[0])
            lines[0] = b"".join(self._line)
            self._line = []
        last = lines.pop()
        if last:
            self._line.append(last)
        for line in lines:
            found = self._line_of(line)
            if found is not None:
                return found
        return None

    def end(self) -> dict[str, Any]:
        """The stream ended: a last event it did not close with a blank line counts.

        Raises:
            MCPError: no response (``CONNECTION_CLOSED``), or as :meth:`feed`.
            NeedsSdk: as :meth:`feed`.
        """
        self._pending_cr = False
        if self._line:
            line, self._line = b"".join(self._line), []
            found = self._line_of(line)
            if found is not None:
                return found
        found = self._line_of(b"")
        if found is not None:
            return found
        raise mcp_error(CONNECTION_CLOSED, "SSE stream ended without a response")

    def _line_of(self, line: bytes) -> dict[str, Any] | None:
        if line:
            if line.startswith(b":"):
                return None
            name, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value
            return None
        # A blank line dispatches the event gathered so far.
        data, event = self._data, self._event
        self._data, self._event = [], b""
        if not data or event not in (b"", b"message"):
            return None
        joined = b"\n".join(data)
        if not joined:
            return None  # a priming event
        try:
            return _message(joined.decode("utf-8", "replace"), self._expected)
        except NotJsonRpc as exc:
            raise mcp_error(PARSE_ERROR, f"Failed to parse SSE message: {exc}") from None


def _from_events(body: bytes) -> dict[str, Any]:
    """The response among a whole server-sent event stream's messages (:class:`Events`)."""
    events = Events()
    found = events.feed(body)
    return found if found is not None else events.end()
